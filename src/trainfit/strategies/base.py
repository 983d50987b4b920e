"""The Strategy seam and the single-process strategy.

A strategy wraps the model for its parallelism, says when gradients may sync, and offers
the few collectives the step needs (token count, overflow flag). It asks the precision
policy for dtypes; precision never looks at the strategy.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from torch import nn


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


class Single:
    """One process, one device: every collective is a no-op."""

    name = "single"
    rank = 0
    world_size = 1

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def wrap(self, model: nn.Module, precision, block_names: list[str]) -> nn.Module:
        return model.to(self.device)

    def sync_context(self, model: nn.Module, is_last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        pass

    def all_reduce_max(self, t: torch.Tensor) -> None:
        pass

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> float:
        # Host-device sync: reads the norm back.
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
