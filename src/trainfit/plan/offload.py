"""The price of offload (pure): bytes that cross the host link per optimizer step, and what they cost.

Each ``--offload`` part under each strategy moves a known amount per step (``levers/offload.py`` says
what lives where). ``n`` below is the trainable parameters, ``N`` the world size, ``A`` the
micro-batches per step; "per rank" throughout.

=======================  ==========================================  ==========================================
part, strategy           down (device -> host)                       up (host -> device)
=======================  ==========================================  ==========================================
optimizer, single/ddp    gradients once: n x grad dtype bytes        weights once: n x weight dtype bytes
optimizer, zero2         sharded fp32 grads: 4 n / N per             fp32 shards: 4 n / N per gather, one
(CPUOffloadPolicy)       reduce-scatter (1, or A per-micro-batch)    gather per micro-batch
optimizer,params, zero3  the same                                    two gathers per micro-batch (forward and
                                                                     backward)
activations, any         the saved bytes of each micro-batch (A x)   the same, read back in backward
=======================  ==========================================  ==========================================

Seconds = bytes / ``host_bytes_per_s`` (``meters.devices.DEVICES[name].host_bytes_per_s``, one direction,
datasheet; or ``measure_host_copy()`` for ``plan --calibrate`` on a CPU). Down and up are summed: an
upper bound that assumes no overlap of the copies with compute or with each other (PCIe is full duplex;
FSDP2 and the pinned copies can overlap with compute, so a measured step is usually cheaper).

The planner calls :func:`offload_price` once per candidate plan and turns its ``reason`` into the plan's
reasons line ("offload: frees 42 GiB per device, costs 1.8 s/step over the host link").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainfit.units import fmt_bytes
from trainfit.vocabulary import GradSync, OffloadPart, StrategyName

_FSDP = (StrategyName.ZERO2, StrategyName.ZERO3)


@dataclass(frozen=True, kw_only=True)
class OffloadTraffic:
    """One offloaded part's traffic over the host link in one optimizer step, per rank."""

    part: str
    """What moves: optimizer (single/ddp), optimizer+params (FSDP2's policy) or activations."""
    down_bytes: int
    """Device -> host per step."""
    up_bytes: int
    """Host -> device per step."""
    frees_device_bytes: int
    """Device bytes this part no longer holds (what it buys)."""

    @property
    def bytes_per_step(self) -> int:
        return self.down_bytes + self.up_bytes

    def seconds(self, host_bytes_per_s: float | None) -> float | None:
        """Seconds per step at a one-direction host link bandwidth, copies not overlapped; None: unknown link."""
        if not host_bytes_per_s:
            return None
        return self.bytes_per_step / host_bytes_per_s


@dataclass(frozen=True, kw_only=True)
class OffloadPrice:
    """Every part's traffic, and the total in seconds and in words."""

    traffic: tuple[OffloadTraffic, ...]
    host_bytes_per_s: float | None
    """The link bandwidth priced at (None: unknown, seconds are None)."""

    @property
    def bytes_per_step(self) -> int:
        return sum(t.bytes_per_step for t in self.traffic)

    @property
    def frees_device_bytes(self) -> int:
        return sum(t.frees_device_bytes for t in self.traffic)

    @property
    def seconds_per_step(self) -> float | None:
        if not self.host_bytes_per_s:
            return None
        return self.bytes_per_step / self.host_bytes_per_s

    @property
    def reason(self) -> str:
        """The plan's reasons line for offload ('' when nothing is offloaded)."""
        if not self.traffic:
            return ""
        parts = ",".join(t.part for t in self.traffic)
        cost = (f"costs {self.seconds_per_step:.3g} s/step over the host link "
                f"({fmt_bytes(self.bytes_per_step)} at {self.host_bytes_per_s / 1e9:.3g} GB/s)"
                if self.seconds_per_step is not None else
                f"moves {fmt_bytes(self.bytes_per_step)}/step over a host link of unknown bandwidth")
        return f"offload {parts}: frees {fmt_bytes(self.frees_device_bytes)} per device, {cost}"


OFFLOAD_CHOICES = ("", "optimizer", "activations", "activations,optimizer")
"""What the planner offers to offload ("" nothing); under zero3 "optimizer" runs as "optimizer,params"."""


def offload_choices(strategy: str) -> tuple[str, ...]:
    """The ``--offload`` settings of OFFLOAD_CHOICES that ``strategy`` runs, spelled as it runs them.

    The rules of ``levers/offload.OffloadPlan``, restated because the planner imports no torch (a test holds
    the two equal): zero3 moves the parameters with the optimizer state (FSDP2's policy moves both), zero1
    cannot offload its optimizer (its broadcast sends device tensors), params alone never.
    """
    strategy = StrategyName(strategy)
    if strategy == StrategyName.ZERO1:
        return tuple(x for x in OFFLOAD_CHOICES if OffloadPart.OPTIMIZER not in x.split(","))
    if strategy == StrategyName.ZERO3:
        return tuple(",".join(sorted([*x.split(","), OffloadPart.PARAMS])) if OffloadPart.OPTIMIZER in x.split(",")
                     else x for x in OFFLOAD_CHOICES)
    return OFFLOAD_CHOICES


def offload_as_run(wanted: str, strategy: str) -> str | None:
    """``wanted`` (one of OFFLOAD_CHOICES) as ``strategy`` runs it (zero3 adds params), or None where it cannot."""
    for choice in offload_choices(strategy):
        if set(choice.split(",")) - {OffloadPart.PARAMS} == set(wanted.split(",")):
            return choice
    return None


def offload_price(*, parts: frozenset[OffloadPart] | set[str], strategy: str, n_params: int, world_size: int = 1,
                  accumulation: int = 1, weight_bytes: int = 4, grad_bytes: int | None = None,
                  state_bytes_per_param: int = 8, master_bytes_per_param: int = 0,
                  activation_bytes_per_micro_batch: int = 0, grad_sync: str = GradSync.DEFERRED,
                  host_bytes_per_s: float | None = None) -> OffloadPrice:
    """The host-link traffic and device savings of ``parts`` under ``strategy``, per rank and step.

    Args:
        parts: the offloaded parts (``vocabulary.parse_offload(cfg.offload)``).
        strategy: single, ddp, zero2 or zero3 (``levers/offload.plan_offload`` refuses the rest).
        n_params: trainable parameters of the whole model.
        world_size: ranks (FSDP2 shards by it).
        accumulation: micro-batches per optimizer step.
        weight_bytes: bytes per parameter as the device stores it (2 under bf16-true/fp16-true, else 4).
        grad_bytes: bytes per gradient element on the device (default: ``weight_bytes``).
        state_bytes_per_param: optimizer state (AdamW 8, SGD with momentum 4, plain SGD 0).
        master_bytes_per_param: fp32 master the device would otherwise hold (4 under *-true, else 0).
        activation_bytes_per_micro_batch: bytes saved for backward per micro-batch (the estimator's
            activations part, or the tracker's host activations under ``--offload activations``).
        grad_sync: FSDP2 under accumulation: deferred (one reduce-scatter per step) or per-micro-batch.
        host_bytes_per_s: one-direction device-host bandwidth (None: seconds unknown).
    """
    parts = {str(p) for p in parts}
    strategy = StrategyName(strategy)
    grad_bytes = weight_bytes if grad_bytes is None else grad_bytes
    out = []
    if OffloadPart.OPTIMIZER in parts and strategy in _FSDP:
        shard = math.ceil(n_params / world_size)
        gathers = accumulation * (2 if strategy == StrategyName.ZERO3 else 1)
        scatters = accumulation if grad_sync == GradSync.PER_MICRO_BATCH else 1
        name = "optimizer,params" if strategy == StrategyName.ZERO3 else "optimizer"
        # fp32 shards, their fp32 grads and the state leave the device (FSDP2's sharded parameters are fp32)
        out.append(OffloadTraffic(part=name, down_bytes=4 * shard * scatters, up_bytes=4 * shard * gathers,
                                  frees_device_bytes=(4 + 4 + state_bytes_per_param) * shard))
    elif OffloadPart.OPTIMIZER in parts:
        out.append(OffloadTraffic(part="optimizer", down_bytes=grad_bytes * n_params, up_bytes=weight_bytes * n_params,
                                  frees_device_bytes=(state_bytes_per_param + master_bytes_per_param) * n_params))
    if OffloadPart.ACTIVATIONS in parts:
        moved = activation_bytes_per_micro_batch * accumulation
        out.append(OffloadTraffic(part="activations", down_bytes=moved, up_bytes=moved,
                                  frees_device_bytes=activation_bytes_per_micro_batch))
    return OffloadPrice(traffic=tuple(out), host_bytes_per_s=host_bytes_per_s)


__all__ = ["OFFLOAD_CHOICES", "OffloadTraffic", "OffloadPrice", "offload_as_run", "offload_choices", "offload_price"]
