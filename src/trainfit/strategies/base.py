"""The Strategy seam (the single-process strategy is in :mod:`trainfit.strategies.single`).

A strategy wraps the model for its parallelism, says when gradients may sync, offers the few
collectives the step needs (token count, overflow flag), partitions the optimizer where it
shards its state, and saves/loads checkpoints in its format. It asks the precision policy for
dtypes (``precision.fsdp_policy()``); precision never looks at the strategy.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from trainfit.config import RunConfig
from trainfit.levers.precision import Precision


class Checkpointed(Protocol):
    """What a strategy reads of the run it saves and loads; :class:`trainfit.run.Run` is one. Declared here,
    below the run, so the strategies never import upward (not even for annotations)."""

    cfg: RunConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    precision: Precision
    strategy: Strategy

    def state(self, step: int) -> dict:
        """The whole one-file checkpoint after ``step`` optimizer steps."""

    def restore(self, state: dict, path: Path) -> int:
        """Load a one-file checkpoint; the next step to run."""


class Strategy(Protocol):
    name: str
    rank: int
    world_size: int
    device: torch.device

    def wrap(self, model: nn.Module, precision, block_names: list[str]) -> nn.Module: ...

    def sync_context(self, model: nn.Module, is_last: bool) -> contextlib.AbstractContextManager:
        """Around forward+backward of one micro-batch; suppresses gradient sync unless ``is_last``."""

    def all_reduce_sum(self, t: torch.Tensor) -> None: ...

    def all_reduce_max(self, t: torch.Tensor) -> None: ...

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> float:
        """Clip the global norm of ``p.grad`` over ``params``; return the norm before clipping."""

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer this rank steps (zero1: over its partition only; otherwise ``optimizer`` itself)."""

    def save(self, run: Checkpointed, step: int) -> None:
        """Checkpoint ``run`` after ``step`` optimizer steps (a collective where the strategy is distributed)."""

    def load(self, run: Checkpointed, run_dir: Path) -> int | None:
        """Restore the newest checkpoint in ``run_dir`` into ``run``; the next step, or None when there is none."""


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a strategy's wrapper (DDP keeps it in ``.module``; FSDP2 shards in place)."""
    return getattr(model, "module", model)
