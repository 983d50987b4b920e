"""Compatibility rules: one table of (lever, requirement, reason). Pure.

Every candidate the planner enumerates is checked against every row; a candidate that
breaks a row is not ranked, and the row's reason is reported. Rows the strategies enforce
at run time (``strategies.compat``) are imported, not restated, so plan and run agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainfit.plan.cost import Candidate
from trainfit.strategies.compat import UNSUPPORTED


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
    return [Rule(lever=f"strategy={s} + precision={p}", requirement="not combined", reason=why,
                 applies=lambda c, s=s, p=p: c.strategy == s and c.precision == p, holds=lambda c, x: False)
            for (s, p), why in UNSUPPORTED.items()]


RULES: tuple[Rule, ...] = (
    Rule(lever="strategy=single", requirement="exactly 1 device",
         reason="single runs on one device; with more devices use ddp or zero1-3",
         applies=lambda c: c.strategy == "single", holds=lambda c, x: x.devices == 1),
    Rule(lever="strategy=ddp|zero1|zero2|zero3", requirement="at least 2 devices",
         reason="data parallelism needs devices to replicate or shard across",
         applies=lambda c: c.strategy != "single", holds=lambda c, x: x.devices >= 2),
    Rule(lever="precision=bf16-*", requirement="the device has bf16 arithmetic",
         reason="bf16 needs hardware support (e.g. not on V100 or T4)",
         applies=lambda c: c.precision.startswith("bf16"), holds=lambda c, x: "bf16" in x.dtypes),
    Rule(lever="precision=fp16-*", requirement="the device has fp16 arithmetic",
         reason="fp16 needs hardware support",
         applies=lambda c: c.precision.startswith("fp16"), holds=lambda c, x: "fp16" in x.dtypes),
    Rule(lever="grad_sync=per-micro-batch", requirement="strategy zero2 or zero3 and accumulation > 1",
         reason="only sharded gradients accumulated over several micro-batches can sync per micro-batch; "
                "elsewhere it is the same run as deferred",
         applies=lambda c: c.grad_sync == "per-micro-batch",
         holds=lambda c, x: c.strategy in ("zero2", "zero3") and c.accumulation > 1),
    *_strategy_precision_rows(),
)


def broken_rules(c: Candidate, ctx: Context) -> list[Rule]:
    """The rows candidate ``c`` breaks (empty: compatible)."""
    return [r for r in RULES if r.applies(c) and not r.holds(c, ctx)]
