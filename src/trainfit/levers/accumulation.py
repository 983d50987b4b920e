"""Gradient accumulation: K micro-batches give exactly the gradient of the one big batch.

The big batch's loss is ``sum of per-token losses / total tokens``. So each micro-batch's
*sum* is divided by the token count of the **whole window** (all micro-batches, all ranks),
never averaged per micro-batch: a mean of means weights a 30-token micro-batch as much as
a 510-token one and gives the wrong gradient whenever counts differ (padding, ignored
labels, a partial last window).

Data-parallel strategies *average* gradients over ranks, so the weight is multiplied back
by the world size: ``weight = world_size / global_count``.

Pure core: :func:`loss_weight`. Shell: :class:`AccumulationWindow`, a one-shot state
machine (OPEN -> RUNNING -> DONE) that knows the window's total count and which
micro-batch is last (the one where gradient sync happens).
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

AllReduceSum = Callable[[torch.Tensor], None]


def loss_weight(global_count: int, world_size: int = 1) -> float:
    """Factor applied to each micro-batch's loss *sum* (pure)."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} is not valid; allowed: an integer >= 1")
    return world_size / max(global_count, 1)


class WindowState(enum.Enum):
    OPEN = "open"
    RUNNING = "running"
    DONE = "done"


class AccumulationWindow:
    """The micro-batches of one optimizer step.

    Args:
        micro_batches: this rank's micro-batches for the step (any sizes, any count >= 1).
        count: returns the loss-bearing tokens/samples of a micro-batch (before forward).
        all_reduce_sum: in-place SUM across ranks, or None on one process.
        world_size: ranks whose gradients the strategy averages.
    """

    def __init__(
        self,
        micro_batches: Sequence,
        count: Callable[[object], int],
        *,
        all_reduce_sum: AllReduceSum | None = None,
        world_size: int = 1,
    ) -> None:
        if len(micro_batches) < 1:
            raise ValueError("an accumulation window needs at least one micro-batch")
        self.micro_batches = list(micro_batches)
        local = sum(count(mb) for mb in self.micro_batches)
        if all_reduce_sum is not None and world_size > 1:
            # One tiny collective per optimizer step; skipped on one rank, where it would only cost a tensor
            # and a read-back (~20 us of the step's fixed cost, benchmarks/overhead.py).
            total = torch.tensor([float(local)], dtype=torch.float64)
            all_reduce_sum(total)
            local = total.item()
        self.global_count = int(local)
        self.weight = loss_weight(self.global_count, world_size)
        self.state = WindowState.OPEN

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __iter__(self) -> Iterator[tuple[object, bool]]:
        """Yield ``(micro_batch, is_last)``; gradients may be synced only when ``is_last``."""
        if self.state is not WindowState.OPEN:
            raise RuntimeError(f"accumulation window already {self.state.value}; build a new one per step")
        self.state = WindowState.RUNNING
        last = len(self.micro_batches) - 1
        for i, mb in enumerate(self.micro_batches):
            yield mb, i == last
        self.state = WindowState.DONE


_warned: set[int] = set()


def batchnorm_layers(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def warn_if_batchnorm(model: nn.Module, accumulation: int) -> list[str]:
    """Warn once per model when accumulation cannot be exact because of BatchNorm."""
    names = batchnorm_layers(model)
    if names and accumulation > 1 and id(model) not in _warned:
        _warned.add(id(model))
        warnings.warn(
            f"accumulation={accumulation}: BatchNorm layers {', '.join(names)} normalise over each "
            "micro-batch only, so the result differs from one big batch (consider GroupNorm/LayerNorm "
            "or SyncBatchNorm-style statistics)",
            stacklevel=2,
        )
    return names
