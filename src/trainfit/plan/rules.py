"""Compatibility rules: one table of (lever, requirement, reason). Pure.

Every candidate the planner enumerates is checked against every row; a candidate that
breaks a row is not ranked, and the row's reason is reported. Rows the strategies enforce
at run time (``vocabulary.refusal``) are read from the same rows, not restated, so plan and run agree.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from trainfit.plan.cost import Candidate
from trainfit.vocabulary import PRECISIONS, STRATEGIES, Dtype, GradSync, precision_facts, refusal


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


def rules() -> tuple[Rule, ...]:
    """Every row, built from the strategy and precision tables as they are when called (so a row registered
    later counts); the same names give the same rows, built once (``vocabulary.register_strategy`` adds a name,
    never replaces a row)."""
    return _rules(tuple(STRATEGIES), tuple(PRECISIONS))


@functools.lru_cache(maxsize=4)
def _rules(strategies: tuple, precisions: tuple) -> tuple[Rule, ...]:  # the names: the cache's key
    single = [s.name for s in STRATEGIES.values() if not s.distributed]
    dist = [s.name for s in STRATEGIES.values() if s.distributed]
    per_mb = [s.name for s in STRATEGIES.values() if GradSync.PER_MICRO_BATCH in s.grad_sync_choices]
    return (
        Rule(lever=f"strategy={'|'.join(single)}", requirement="exactly 1 device",
             reason=f"{' / '.join(single)} runs on one device; with more devices use {', '.join(dist)}",
             applies=lambda c: not STRATEGIES[c.strategy].distributed, holds=lambda c, x: x.devices == 1),
        Rule(lever=f"strategy={'|'.join(dist)}", requirement="at least 2 devices",
             reason="data parallelism needs devices to replicate or shard across",
             applies=lambda c: STRATEGIES[c.strategy].distributed, holds=lambda c, x: x.devices >= 2),
        Rule(lever="precision=bf16-*", requirement="the device has bf16 arithmetic",
             reason="bf16 needs hardware support (e.g. not on V100 or T4)",
             applies=lambda c: precision_facts(c.precision).compute == Dtype.BF16,
             holds=lambda c, x: Dtype.BF16 in x.dtypes),
        Rule(lever="precision=fp16-*", requirement="the device has fp16 arithmetic",
             reason="fp16 needs hardware support",
             applies=lambda c: precision_facts(c.precision).compute == Dtype.FP16,
             holds=lambda c, x: Dtype.FP16 in x.dtypes),
        Rule(lever=f"grad_sync={GradSync.PER_MICRO_BATCH}", requirement=f"strategy {' or '.join(per_mb)} and "
                                                                       "accumulation > 1",
             reason="only sharded gradients accumulated over several micro-batches can sync per micro-batch; "
                    "elsewhere it is the same run as deferred",
             applies=lambda c: c.grad_sync == GradSync.PER_MICRO_BATCH,
             holds=lambda c, x: GradSync.PER_MICRO_BATCH in STRATEGIES[c.strategy].grad_sync_choices
             and c.accumulation > 1),
        # The basis separates what stays on the device only without autocast and in fp32 (measured): the
        # precision's row says which that is (compute and weights fp32).
        Rule(lever="offload=activations", requirement="precision fp32 and checkpointing none",
             reason="only there does the planner's basis say what stays on the device (within 4% of the tracker on "
                    "CPU); under checkpointing the blocks recomputed in backward stay on the device, and in half "
                    "precision so do autocast's weight casts and the loss's fp32 copies of the logits, which the basis "
                    "does not separate (measured: device peaks 4-26% above the prediction). Offload and checkpointing "
                    "are two answers to one part: checkpointing is searched for the rest",
             applies=lambda c: "activations" in c.offload.split(","),
             holds=lambda c, x: c.checkpointing == "none" and precision_facts(c.precision).compute == Dtype.FP32
             and precision_facts(c.precision).weights == Dtype.FP32),
        *_strategy_precision_rows(),
    )


def __getattr__(name: str):
    if name == "RULES":  # the rows as of now (a module constant would miss rows registered after import)
        return rules()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def broken_rules(c: Candidate, ctx: Context) -> list[Rule]:
    """The rows candidate ``c`` breaks (empty: compatible)."""
    return [r for r in rules() if r.applies(c) and not r.holds(c, ctx)]
