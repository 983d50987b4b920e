"""Data parallel: ``ddp`` (DistributedDataParallel) and ``zero1`` (DDP + ZeroRedundancyOptimizer).

Every rank holds the whole model; DDP all-reduces (averages) gradients during the backward
of the last micro-batch only (``no_sync`` before it, unless ``grad_sync="per-micro-batch"``).

zero1 is DDP plus :class:`~torch.distributed.optim.ZeroRedundancyOptimizer`: the gradients
are all-reduced in full as under DDP, but each rank keeps the optimizer state (Adam's m and v)
of only its partition of the parameters, steps that partition and broadcasts it. Whole
parameters are partitioned (greedily, largest first, to the least-loaded rank), so the
per-rank share is balanced only to within one parameter's size. Why this and not FSDP2:
FSDP2 always reduce-scatters gradients into shards, so any FSDP2 arrangement is at least
ZeRO-2; ZeRO-1's point is to keep DDP's all-reduce and full gradients, shard only the state.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from trainfit.strategies import dist_checkpoint
from trainfit.strategies import process_group as pg
from trainfit.strategies.base import Checkpointed
from trainfit.vocabulary import GradSync, StrategyName


class Distributed:
    """Collectives shared by every multi-process strategy."""

    name = "distributed"

    def __init__(self, world: pg.World, *, grad_sync: str = "deferred") -> None:
        self.rank = world.rank
        self.world_size = world.world_size
        self.device = world.device
        self.grad_sync = grad_sync

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        pg.all_reduce(t, dist.ReduceOp.SUM, self.device)

    def all_reduce_max(self, t: torch.Tensor) -> None:
        pg.all_reduce(t, dist.ReduceOp.MAX, self.device)

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def save(self, run: Checkpointed, step: int) -> None:
        """Sharded, directory-atomic checkpoint (see :mod:`trainfit.strategies.dist_checkpoint`)."""
        dist_checkpoint.save(run, step)

    def load(self, run: Checkpointed, run_dir: Path) -> int | None:
        return dist_checkpoint.resume(run, run_dir)

    def defer_sync(self, is_last: bool) -> bool:
        """Whether this micro-batch's gradients stay local (accumulated, synced later)."""
        return self.grad_sync == GradSync.DEFERRED and not is_last

    @torch.no_grad()
    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> float:
        """Clip the global L2 norm (same formula as ``torch.nn.utils.clip_grad_norm_``).

        Gradients may be DTensor shards (FSDP2): each rank sums the squares of its shard and
        the sums are all-reduced; replicated gradients (DDP) are already whole on every rank.
        """
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return 0.0
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in local]).sum()
        if any(isinstance(g, DTensor) for g in grads):
            self.all_reduce_sum(sq)
        norm = float(sq.sqrt())  # host-device sync
        coef = min(max_norm / (norm + 1e-6), 1.0)
        if coef < 1.0:
            torch._foreach_mul_(local, coef)
        return norm


class DDP(Distributed):
    """``ddp``: replicate the model, all-reduce gradients once per optimizer step."""

    name = str(StrategyName.DDP)

    def wrap(self, model: nn.Module, precision, block_names: list[str]) -> nn.Module:
        model.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's weights at construction: every rank starts identical.
        return DistributedDataParallel(model, device_ids=ids)

    def sync_context(self, model: nn.Module, is_last: bool) -> contextlib.AbstractContextManager:
        return model.no_sync() if self.defer_sync(is_last) else contextlib.nullcontext()


class Zero1(DDP):
    """``zero1``: DDP gradients, optimizer state partitioned by whole parameters."""

    name = str(StrategyName.ZERO1)

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # The groups as built (e.g. no weight decay on biases, norms, embeddings), each with only the settings
        # that differ from the optimizer's defaults; ZeRO partitions every group and keeps its settings.
        groups = [{k: v for k, v in g.items() if k == "params" or optimizer.defaults.get(k) != v}
                  for g in optimizer.param_groups]
        # The local optimizer gets the same class and hyperparameters, over this rank's partition only.
        # (AdamW records defaults its constructor does not take, e.g. decoupled_weight_decay: drop them.)
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        zero = ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)
        # Readers of ``optimizer.state`` (the memory tracker, DCP) then see the partition this rank holds.
        zero.state = zero.optim.state
        return zero
