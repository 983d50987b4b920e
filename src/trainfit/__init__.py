"""trainfit: make a PyTorch training run fit in memory and scale -- measuring first.

The public names below are imported on first use (PEP 562), so ``import trainfit`` and the command line
pay for the step and its strategies (``torch.distributed.tensor`` among them, about a second) only when
they use them: a cached ``trainfit plan`` answers without them.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
__all__ = ["optimizer_step", "StepResult", "make_precision", "apply_checkpointing", "parse_checkpoint_policy"]

_HOMES = {"optimizer_step": "trainfit.engine", "StepResult": "trainfit.engine",
          "make_precision": "trainfit.levers.precision", "apply_checkpointing": "trainfit.levers.checkpointing",
          "parse_checkpoint_policy": "trainfit.levers.checkpointing"}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'trainfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
