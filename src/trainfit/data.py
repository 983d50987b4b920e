"""Deterministic data order, split across ranks.

The global batch of optimizer step ``s`` is samples ``[s*B, (s+1)*B)`` of an endless
stream that visits a fresh seeded permutation of the dataset each epoch. Rank ``r`` of
``W`` takes the r-th contiguous slice of it and cuts that into micro-batches. So every
sample is seen once per epoch across the world, the order does not depend on the world
size, and resuming at step ``s`` needs only ``s``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Sampler


def global_indices(step: int, global_batch: int, dataset_size: int, seed: int) -> list[int]:
    """Sample indices of one optimizer step's global batch (pure)."""
    out: list[int] = []
    pos = step * global_batch
    while len(out) < global_batch:
        epoch, offset = divmod(pos, dataset_size)
        perm = torch.randperm(dataset_size, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        take = min(global_batch - len(out), dataset_size - offset)
        out.extend(perm[offset : offset + take].tolist())
        pos += take
    return out


def rank_micro_batches(step: int, *, micro_batch: int, accumulation: int, rank: int, world_size: int,
                       dataset_size: int, seed: int) -> list[list[int]]:
    """This rank's micro-batches (index lists) for one optimizer step (pure)."""
    per_rank = micro_batch * accumulation
    idx = global_indices(step, per_rank * world_size, dataset_size, seed)[rank * per_rank : (rank + 1) * per_rank]
    return [idx[i : i + micro_batch] for i in range(0, per_rank, micro_batch)]


class StepSampler(Sampler[list[int]]):
    """Yields micro-batch index lists for steps ``start_step, start_step+1, ...``."""

    def __init__(self, *, start_step: int, micro_batch: int, accumulation: int, rank: int, world_size: int,
                 dataset_size: int, seed: int) -> None:
        self.kw = dict(micro_batch=micro_batch, accumulation=accumulation, rank=rank, world_size=world_size,
                       dataset_size=dataset_size, seed=seed)
        self.start_step = start_step

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            yield from rank_micro_batches(step, **self.kw)
            step += 1


def make_loader(dataset, collate, *, start_step: int, micro_batch: int, accumulation: int, rank: int = 0,
                world_size: int = 1, seed: int = 0, workers: int = 0, pin_memory: bool = False) -> DataLoader:
    sampler = StepSampler(start_step=start_step, micro_batch=micro_batch, accumulation=accumulation, rank=rank,
                          world_size=world_size, dataset_size=len(dataset), seed=seed)
    # Its own generator: iter(DataLoader) otherwise draws a worker seed from the global RNG, which
    # shifts the model's RNG stream (dropout) between a run and its resume.
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=workers,
                      pin_memory=pin_memory, persistent_workers=workers > 0,
                      generator=torch.Generator().manual_seed(seed * 100_003 + start_step))
