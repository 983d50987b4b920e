"""Offload's rules, torch-free: which parts each strategy can keep in host memory and by which mechanism
(what it refuses), and what that frees and costs over the host link. The run (``levers/offload.py``, the
torch shell), the planner (``plan/offload.py``, ``plan/search.py``) and the integrations read these; none
restates them. Every strategy-dependent answer reads the strategy's row (``vocabulary.STRATEGIES``):
``offload_parts`` (what it can offload), ``fsdp`` (FSDP2's CPUOffloadPolicy instead of trainfit's host
optimizer), ``reshard_after_forward`` (gathers per micro-batch) and ``offload_refusal`` (why not).

What lives where (the shell's docstring has the mechanisms):

==========================  =========================================================================
row facts + part            what lives on the host, and what crosses the host link per step
==========================  =========================================================================
not fsdp + optimizer        fp32 master, fp32 gradient buffers and the optimizer state (single, ddp):
                            gradients down, weights up, once per step
fsdp + optimizer            FSDP2's CPUOffloadPolicy: sharded fp32 parameters, their sharded
                            gradients and the state (zero2); where ``params`` is in the row's
                            ``offload_parts`` (zero3) both parts must be named: the policy moves both
any + activations           tensors saved for backward, copied down in forward, up in backward
==========================  =========================================================================

The price (per rank and optimizer step; ``n`` trainable parameters, ``N`` ranks, ``A`` micro-batches):

=======================  ==========================================  ==========================================
part, row                down (device -> host)                       up (host -> device)
=======================  ==========================================  ==========================================
optimizer, not fsdp      gradients once: n x grad dtype bytes        weights once: n x weight dtype bytes
optimizer, fsdp          sharded fp32 grads: 4 n / N per             fp32 shards: 4 n / N per gather, one
(CPUOffloadPolicy)       reduce-scatter (1, or A per-micro-batch)    gather per micro-batch, two where the row
                                                                     reshards after forward (zero3)
activations, any         the saved bytes of each micro-batch (A x)   the same, read back in backward
=======================  ==========================================  ==========================================

Seconds = bytes / ``host_bytes_per_s`` (``meters.devices.DEVICES[name].host_bytes_per_s``, one direction,
datasheet; or ``measure_host_copy()`` for ``plan --calibrate`` on a CPU). Down and up are summed: an
upper bound that assumes no overlap of the copies with compute or with each other (PCIe is full duplex;
FSDP2 and the pinned copies can overlap with compute, so a measured step is usually cheaper).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainfit.errors import ConfigError
from trainfit.units import fmt_bytes
from trainfit.vocabulary import STRATEGIES, GradSync, OffloadPart, StrategyName, choices, parse_offload, strategy_facts


def _offering(part: OffloadPart) -> str:
    """The strategies whose row offloads ``part`` (read when refusing, so registered rows count)."""
    return choices(s.name for s in STRATEGIES.values() if part in s.offload_parts)


# ---- what can be offloaded, and how --------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """Which parts go to host memory under which strategy, and by which mechanism (validated when built)."""

    parts: frozenset[OffloadPart]
    """The parts ``--offload`` named."""
    strategy: StrategyName
    """The strategy they are offloaded under."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", StrategyName(self.strategy))
        s = strategy_facts(self.strategy)
        spec = ",".join(sorted(self.parts))
        o, p = OffloadPart.OPTIMIZER in self.parts, OffloadPart.PARAMS in self.parts
        if p and OffloadPart.PARAMS not in s.offload_parts:
            raise ConfigError("offload", spec, f"params only with strategy={_offering(OffloadPart.PARAMS)}",
                              "parameters can be gathered from the host only by FSDP2 where it shards them: use "
                              f"--strategy {_offering(OffloadPart.PARAMS)}, or drop params")
        if OffloadPart.PARAMS in s.offload_parts and o != p:
            raise ConfigError("offload", spec, f"optimizer and params together under {s.name}",
                              "FSDP2's CPUOffloadPolicy moves the sharded parameters, their gradients and the "
                              "optimizer state together: pass --offload optimizer,params")
        if o and OffloadPart.OPTIMIZER not in s.offload_parts:
            alike = choices(x.name for x in STRATEGIES.values() if x.distributed == s.distributed
                            and OffloadPart.OPTIMIZER in x.offload_parts and OffloadPart.PARAMS not in x.offload_parts)
            raise ConfigError("offload", spec, f"optimizer with strategy {alike}",
                              s.offload_refusal or f"strategy {s.name} has no way to keep its optimizer on the host")

    @property
    def host_optimizer(self) -> bool:
        """The optimizer state and step on the host, by trainfit (the shell's ``HostOptimizer``): not FSDP."""
        return OffloadPart.OPTIMIZER in self.parts and not strategy_facts(self.strategy).fsdp

    @property
    def fsdp_cpu_offload(self) -> bool:
        """FSDP2's ``CPUOffloadPolicy`` on every unit: zero2 + optimizer, zero3 + optimizer,params."""
        return OffloadPart.OPTIMIZER in self.parts and strategy_facts(self.strategy).fsdp

    @property
    def activations(self) -> bool:
        """Tensors saved for backward go to the host (the shell's ``HostActivations``)."""
        return OffloadPart.ACTIVATIONS in self.parts

    def describe(self) -> tuple[str, ...]:
        """One line per offloaded part: what moves to the host and what crosses the link each step."""
        s = strategy_facts(self.strategy)
        lines = []
        if self.host_optimizer:
            lines.append("optimizer: fp32 weights (master), their gradients and the optimizer state on the host; "
                         "the step runs there (gradients down, weights up, once per step)")
        if self.fsdp_cpu_offload:
            lines.append("optimizer" + (",params" if OffloadPart.PARAMS in self.parts else "")
                         + ": FSDP2 CPUOffloadPolicy -- sharded fp32 parameters, sharded gradients and optimizer "
                         "state on the host, the step there; parameters gathered from the host "
                         + ("for forward and again for backward" if s.reshard_after_forward
                            else "once per step (kept on the device through backward)"))
        if self.activations:
            lines.append("activations: tensors saved for backward copied to the host in forward, back in backward")
        return tuple(lines)


def plan_offload(spec: str, strategy: str) -> OffloadPlan:
    """``cfg.offload`` under ``cfg.strategy`` -> the plan; raises ConfigError for what cannot be done."""
    return OffloadPlan(parts=parse_offload(spec), strategy=StrategyName(strategy))


def single_device_offload(spec: str, strategy: str) -> str:
    """The ``offload`` to trace on one device for a run planned under ``strategy`` (the estimator traces
    single and shards analytically): FSDP2's policy becomes the host optimizer (``params`` dropped; the
    sharded parameters' move to the host is then the estimator's to apply), the rest as given."""
    plan = plan_offload(spec, strategy)
    return ",".join(sorted(p for p in plan.parts if p != OffloadPart.PARAMS))


def host_optimizer_bytes(*, n_trainable: int, state_bytes_per_param: int) -> dict[str, int]:
    """Host bytes of the shell's ``HostOptimizer`` (the policy's arithmetic, for tests and the planner).

    Args:
        n_trainable: trainable floating-point parameters (elements).
        state_bytes_per_param: optimizer state per parameter (Adam/AdamW 8, SGD with momentum 4).
    Returns:
        ``{"optimizer": fp32 master + state, "grads": fp32 gradient buffers}`` on the host; the device
        keeps none of either.
    """
    return {"optimizer": (4 + state_bytes_per_param) * n_trainable, "grads": 4 * n_trainable}


OFFLOAD_CHOICES = ("", "optimizer", "activations", "activations,optimizer")
"""What the planner offers to offload ("" nothing); where the row offloads params (zero3) "optimizer" runs as
"optimizer,params"."""


def offload_choices(strategy: str) -> tuple[str, ...]:
    """The ``--offload`` settings of OFFLOAD_CHOICES that ``strategy`` runs, spelled as it runs them: the rules
    of :class:`OffloadPlan` (a row without ``optimizer`` drops those settings; a row with ``params`` names it with
    ``optimizer``; params alone never)."""
    can = strategy_facts(strategy).offload_parts
    out = []
    for x in OFFLOAD_CHOICES:
        parts = set(filter(None, x.split(",")))
        if OffloadPart.OPTIMIZER in parts and OffloadPart.OPTIMIZER not in can:
            continue
        if OffloadPart.OPTIMIZER in parts and OffloadPart.PARAMS in can:
            parts.add(OffloadPart.PARAMS)
        out.append(",".join(sorted(parts)))
    return tuple(out)


def offload_as_run(wanted: str, strategy: str) -> str | None:
    """``wanted`` (one of OFFLOAD_CHOICES) as ``strategy`` runs it (zero3 adds params), or None where it cannot."""
    for choice in offload_choices(strategy):
        if set(choice.split(",")) - {OffloadPart.PARAMS} == set(wanted.split(",")):
            return choice
    return None


# ---- what it frees and costs ------------------------------------------------------------------------
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


def offload_price(*, parts: frozenset[OffloadPart] | set[str], strategy: str, n_params: int, world_size: int = 1,
                  accumulation: int = 1, weight_bytes: int = 4, grad_bytes: int | None = None,
                  state_bytes_per_param: int = 8, master_bytes_per_param: int = 0,
                  activation_bytes_per_micro_batch: int = 0, grad_sync: str = GradSync.DEFERRED,
                  host_bytes_per_s: float | None = None) -> OffloadPrice:
    """The host-link traffic and device savings of ``parts`` under ``strategy``, per rank and step.

    Args:
        parts: the offloaded parts (``vocabulary.parse_offload(cfg.offload)``).
        strategy: a strategy whose row offloads ``parts`` (:func:`plan_offload` refuses the rest).
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
    s = strategy_facts(strategy)
    grad_bytes = weight_bytes if grad_bytes is None else grad_bytes
    out = []
    if OffloadPart.OPTIMIZER in parts and s.fsdp:
        shard = math.ceil(n_params / world_size)
        gathers = accumulation * (2 if s.reshard_after_forward else 1)
        scatters = accumulation if grad_sync == GradSync.PER_MICRO_BATCH else 1
        name = "optimizer,params" if OffloadPart.PARAMS in s.offload_parts else "optimizer"
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


__all__ = ["OFFLOAD_CHOICES", "OffloadPlan", "OffloadPrice", "OffloadTraffic", "host_optimizer_bytes", "offload_as_run",
           "offload_choices", "offload_price", "plan_offload", "single_device_offload"]
