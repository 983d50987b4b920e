"""``zero2`` and ``zero3`` on FSDP2 (``fully_shard``): gradients and optimizer state sharded,
and for zero3 the parameters too.

Each repeated block (``task.block_names``) becomes its own FSDP unit, then the root takes
the rest (embeddings, final norm, head), so at most one block's parameters are gathered at
a time. zero2 keeps the gathered parameters from forward to backward
(``reshard_after_forward=False``: one all-gather per step, parameters whole between them);
zero3 frees them after forward and gathers again in backward (less memory, 1.5x traffic).
Every tensor is split along dim 0 into ``world_size`` near-equal shards (the last may be
shorter), so each rank's part is ~1/N of the whole.

Precision maps onto :class:`MixedPrecisionPolicy` (the precision's ``fsdp_policy()``): the sharded
weights stay fp32 (they are the optimizer's master copy), the gathered ones are cast to the
compute dtype, gradients are reduce-scattered in fp32.

Gradient sync under accumulation (``grad_sync``):
  deferred         ``set_requires_gradient_sync(False)`` until the last micro-batch: whole
                   fp32 gradients accumulate locally (ZeRO-2's memory saving is lost during
                   the window), one reduce-scatter per step.
  per-micro-batch  reduce-scatter after every micro-batch into the sharded gradient:
                   gradient memory stays 1/N, traffic is ``accumulation`` times higher.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from trainfit.strategies import process_group as pg
from trainfit.strategies.ddp import Distributed
from trainfit.vocabulary import StrategyFacts


def mixed_precision_policy(precision) -> MixedPrecisionPolicy:
    """The FSDP2 policy for a precision (asks the precision; never the other way round)."""
    param, reduce = precision.fsdp_policy()
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


class FSDP(Distributed):
    """zero2 / zero3 on FSDP2 (``fully_shard`` per block, then the root), from the strategy's vocabulary row."""

    def __init__(self, world: pg.World, *, facts: StrategyFacts, grad_sync: str = "deferred") -> None:
        super().__init__(world, grad_sync=grad_sync)
        self.name = str(facts.name)
        self.reshard_after_forward = facts.reshard_after_forward

    def wrap(self, model: nn.Module, precision, block_names: list[str], *, cpu_offload: bool = False) -> nn.Module:
        """Shard each block, then the root. ``cpu_offload`` (``--offload optimizer[,params]``, decided by
        ``levers/offload.py``): FSDP2's ``CPUOffloadPolicy`` -- the sharded fp32 parameters, their sharded
        gradients and the optimizer state rest in host memory (pinned under CUDA) and the optimizer steps
        there; each unit's parameters are copied up and gathered for forward (zero3: again for backward),
        its gradients reduce-scattered on the device and copied down."""
        model.to(self.device)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        kw = dict(mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=mixed_precision_policy(precision))
        if cpu_offload:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        modules = dict(model.named_modules())
        # Innermost first (FSDP2 needs children sharded before their parents), then the root.
        for name in sorted(block_names, key=lambda n: -n.count(".")):
            fully_shard(modules[name], **kw)
        fully_shard(model, **kw)
        return model

    @contextlib.contextmanager
    def sync_context(self, model: nn.Module, is_last: bool) -> Iterator[None]:
        model.set_requires_gradient_sync(not self.defer_sync(is_last))
        yield
