"""The Task seam: what to train.

A Task builds the model, provides a dataset and a collate function, and computes the
loss as ``(loss_sum, n_loss_items)`` -- a *sum* over loss-bearing tokens (or samples)
and their *count*. Returning sum and count (not a mean) is what lets accumulation
divide by the whole window's count, and lets distribution all-reduce the count, so K
micro-batches on N ranks give exactly the gradient of the one big batch.

User models plug in through the same protocol (see :mod:`trainfit.tasks.user`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import Dataset

Batch = Any  # a dict of tensors for the built-ins; anything the task's loss accepts


@runtime_checkable
class Task(Protocol):
    name: str
    """Human-readable model name."""
    unit: str
    """What is counted for throughput and loss normalisation: "tokens" or "samples"."""

    def build_model(self) -> nn.Module: ...

    def block_names(self, model: nn.Module) -> list[str]:
        """Qualified names of the repeated blocks (checkpointing and per-block sharding)."""

    def dataset(self) -> Dataset: ...

    def collate(self, samples: list) -> Batch: ...

    def count(self, batch: Batch) -> int:
        """Loss-bearing tokens/samples in the batch, known before the forward pass."""

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | int]:
        """(sum of per-item losses, number of items) for one micro-batch."""


@dataclass
class GenericTask:
    """A Task assembled from plain callables (used by built-ins, HF models and users)."""

    name: str
    unit: str
    build_model: Callable[[], nn.Module]
    dataset: Callable[[], Dataset]
    collate: Callable[[list], Batch]
    count: Callable[[Batch], int]
    loss: Callable[[nn.Module, Batch], tuple[torch.Tensor, torch.Tensor | int]]
    block_classes: Sequence[str] = ()
    """Class names of the repeated blocks."""
    example_batch: Callable[[int], Batch] | None = None
    """Optional: a worst-case micro-batch of n samples (full-length), for memory accounting."""
    depth_key: str = ""
    """Optional: the model_config key that sets the number of identical blocks (e.g. n_layer), or several
    comma-separated keys set together (an encoder-decoder's two stacks of equal depth); lets the memory
    estimate trace a few blocks and extrapolate. Empty: trace the whole model."""
    depth: int = 0
    """The number of identical blocks the model has (with depth_key)."""
    fake_trace: Callable[[], AbstractContextManager] | None = None
    """Optional: a context the memory estimate enters while stepping under fake tensors, for
    models that branch on ``is fake tensor`` where the real run branches on data (see hf.py)."""
    val_dataset: Callable[[], Dataset | None] = lambda: None
    """The validation rows (``--val-fraction`` / ``--val-data``); None without a split."""
    data_source: str = "generated"
    """Where the rows come from: "generated", or :attr:`trainfit.tasks.files.TextData.source` ("prepared",
    "raw-packed", "raw-on-the-fly"), which profile's advice reads."""
    data_description: str = ""
    """One line about the data from files (documents, tokens, rows); "" for generated data."""

    def block_names(self, model: nn.Module) -> list[str]:
        return [n for n, m in model.named_modules() if type(m).__name__ in self.block_classes and n]


def to_device(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
