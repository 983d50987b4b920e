"""Compatibility rules: one table of (lever, requirement, reason). Pure.

Every candidate the planner enumerates is checked against every row; a candidate that
breaks a row is not ranked, and the row's reason is reported. Rows the strategies enforce
at run time (``vocabulary.refusal``) are read from the same rows, not restated, so plan and run agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainfit.plan.cost import Candidate
from trainfit.vocabulary import PRECISIONS, STRATEGIES, GradSync, PrecisionName, precision_facts, refusal


@dataclass(frozen=True, kw_only=True)
class Context:
    devices: int
    """Total devices (the data-parallel degree)."""
    dtypes: tuple[str, ...]
    """Compute dtypes the device has arithmetic for ("fp32", "bf16", "fp16")."""


@dataclass(frozen=True, kw_only=True)
class Rule:
    lever: str
    """The lever setting the rule is about, e.g. "strategy=single"."""
    requirement: str
    """What must hold, in words."""
    reason: str
    """Why."""
    applies: Callable[[Candidate], bool]
    holds: Callable[[Candidate, Context], bool]


def _strategy_precision_rows() -> list[Rule]:
    pairs = [(s, p, refusal(s, p)) for s in STRATEGIES for p in PRECISIONS]
    return [Rule(lever=f"strategy={s} + precision={p}", requirement="not combined", reason=why,
                 applies=lambda c, s=s, p=p: c.strategy == s and c.precision == p, holds=lambda c, x: False)
            for s, p, why in pairs if why]


_SINGLE = [s.name for s in STRATEGIES.values() if not s.distributed]
_DIST = [s.name for s in STRATEGIES.values() if s.distributed]
_PER_MB = [s.name for s in STRATEGIES.values() if GradSync.PER_MICRO_BATCH in s.grad_sync_choices]


RULES: tuple[Rule, ...] = (
    Rule(lever=f"strategy={'|'.join(_SINGLE)}", requirement="exactly 1 device",
         reason=f"{' / '.join(_SINGLE)} runs on one device; with more devices use {', '.join(_DIST)}",
         applies=lambda c: c.strategy in _SINGLE, holds=lambda c, x: x.devices == 1),
    Rule(lever=f"strategy={'|'.join(_DIST)}", requirement="at least 2 devices",
         reason="data parallelism needs devices to replicate or shard across",
         applies=lambda c: c.strategy in _DIST, holds=lambda c, x: x.devices >= 2),
    Rule(lever="precision=bf16-*", requirement="the device has bf16 arithmetic",
         reason="bf16 needs hardware support (e.g. not on V100 or T4)",
         applies=lambda c: precision_facts(c.precision).compute == "bf16", holds=lambda c, x: "bf16" in x.dtypes),
    Rule(lever="precision=fp16-*", requirement="the device has fp16 arithmetic",
         reason="fp16 needs hardware support",
         applies=lambda c: precision_facts(c.precision).compute == "fp16", holds=lambda c, x: "fp16" in x.dtypes),
    Rule(lever=f"grad_sync={GradSync.PER_MICRO_BATCH}", requirement=f"strategy {' or '.join(_PER_MB)} and "
                                                                   "accumulation > 1",
         reason="only sharded gradients accumulated over several micro-batches can sync per micro-batch; "
                "elsewhere it is the same run as deferred",
         applies=lambda c: c.grad_sync == GradSync.PER_MICRO_BATCH,
         holds=lambda c, x: c.strategy in _PER_MB and c.accumulation > 1),
    Rule(lever="offload=activations", requirement="precision fp32 and checkpointing none",
         reason="only there does the planner's basis say what stays on the device (within 4% of the tracker on "
                "CPU); under checkpointing the blocks recomputed in backward stay on the device, and in half "
                "precision so do autocast's weight casts and the loss's fp32 copies of the logits, which the basis "
                "does not separate (measured: device peaks 4-26% above the prediction). Offload and checkpointing "
                "are two answers to one part: checkpointing is searched for the rest",
         applies=lambda c: "activations" in c.offload.split(","),
         holds=lambda c, x: c.checkpointing == "none" and c.precision == PrecisionName.FP32),
    *_strategy_precision_rows(),
)


def broken_rules(c: Candidate, ctx: Context) -> list[Rule]:
    """The rows candidate ``c`` breaks (empty: compatible)."""
    return [r for r in RULES if r.applies(c) and not r.holds(c, ctx)]
