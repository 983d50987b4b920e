"""``single``: one process, one device; every collective is a no-op, checkpoints are one ``.pt`` file."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from trainfit.checkpoint import save_checkpoint
from trainfit.strategies.base import Checkpointed
from trainfit.strategies.dist_checkpoint import resume
from trainfit.vocabulary import StrategyName

_NO_SYNC = contextlib.nullcontext()
"""Nothing to defer on one process (a ``nullcontext`` is re-enterable)."""


class Single:
    """One process, one device: every collective is a no-op."""

    name = str(StrategyName.SINGLE)
    rank = 0
    world_size = 1

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def wrap(self, model: nn.Module, precision, block_names: list[str]) -> nn.Module:
        return model.to(self.device)

    def sync_context(self, model: nn.Module, is_last: bool) -> contextlib.AbstractContextManager:
        return _NO_SYNC  # entered once per micro-batch: one shared no-op, not a new one each time

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        pass

    def all_reduce_max(self, t: torch.Tensor) -> None:
        pass

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> float:
        # Host-device sync: reads the norm back.
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def save(self, run: Checkpointed, step: int) -> None:
        """One ``.pt`` file with its sha256 sidecar, written atomically."""
        save_checkpoint(run.cfg.run_dir, step, run.state(step), keep=run.cfg.keep_checkpoints)

    def load(self, run: Checkpointed, run_dir: Path) -> int | None:
        return resume(run, run_dir)
