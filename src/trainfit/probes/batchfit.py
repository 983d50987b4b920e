"""Batch scaling: activations = fixed + per-sample x batch, and the largest micro-batch for a budget.

Parameters, gradients and optimizer state do not depend on the batch; activations and
temporaries grow linearly with it. Each phase's peak is fitted separately (the optimizer
step's peak is flat, backward's grows), so the micro-batch that fits a budget is the
largest one whose every phase fits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trainfit.config import RunConfig
from trainfit.errors import ConfigError
from trainfit.probes.estimate import estimate_memory
from trainfit.probes.memory import measure_memory
from trainfit.progress import logger, stage
from trainfit.results import MemoryReport
from trainfit.units import fmt_bytes


log = logger("memory")


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x. Returns (a, b, largest |residual| / max(y))."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    worst = max(abs(y - (a + b * x)) for x, y in zip(xs, ys))
    return a, b, worst / max(max(ys), 1)


@dataclass(frozen=True, kw_only=True)
class BatchScaling:
    """Memory as a function of the micro-batch size, fitted from reports at two or more sizes."""

    batches: tuple[int, ...]
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_fixed_bytes: float
    activations_per_sample_bytes: float
    activations_fit_residual: float
    """Largest |residual| of the activations fit over the largest activations (0 with two points)."""
    temporaries_fixed_bytes: float
    temporaries_per_sample_bytes: float
    phase_fits: Mapping[str, tuple[float, float]]
    """Per phase: (fixed, per-sample) bytes of that phase's peak."""
    method: str

    def parts_at(self, batch: int) -> dict[str, int]:
        """Bytes per part at micro-batch ``batch`` (what the planner scales)."""
        return {"params": self.params_bytes, "grads": self.grads_bytes, "optimizer": self.optimizer_bytes,
                "activations": round(self.activations_fixed_bytes + self.activations_per_sample_bytes * batch),
                "temporaries": round(self.temporaries_fixed_bytes + self.temporaries_per_sample_bytes * batch)}

    def peak_at(self, batch: int) -> int:
        return round(max(a + b * batch for a, b in self.phase_fits.values()))

    def max_micro_batch(self, budget_bytes: int) -> int:
        """The largest micro-batch whose peak fits ``budget_bytes``.

        Raises:
            ConfigError: not even micro-batch 1 fits; the message says what to try.
        """
        if self.peak_at(1) > budget_bytes:
            p = self.parts_at(1)
            raise ConfigError(
                "budget", fmt_bytes(budget_bytes),
                f"at least {fmt_bytes(self.peak_at(1))}: not even micro-batch 1 fits (params "
                f"{fmt_bytes(p['params'])}, grads {fmt_bytes(p['grads'])}, optimizer {fmt_bytes(p['optimizer'])}, "
                f"activations {fmt_bytes(p['activations'])})",
                "raise the budget, or shrink the step: --checkpointing full, --precision bf16-true, "
                "--optimizer sgd, or a zero strategy")
        best = math.inf
        for a, b in self.phase_fits.values():
            if b > 0:
                best = min(best, math.floor((budget_bytes - a) / b))
        return int(best) if best != math.inf else 2**31 - 1

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["phase_fits"] = {k: list(v) for k, v in self.phase_fits.items()}
        return d


def scaling_from_reports(reports: Sequence[MemoryReport]) -> BatchScaling:
    """Fit from reports of the same run at different micro-batch sizes (pure)."""
    reports = sorted(reports, key=lambda r: r.batch)
    xs = [r.batch for r in reports]
    if len(set(xs)) < 2:
        raise ConfigError("batches", xs, "at least two different micro-batch sizes")
    a_fix, a_per, a_res = fit_line(xs, [r.activations_bytes for r in reports])
    t_fix, t_per, _ = fit_line(xs, [r.temporaries_bytes for r in reports])
    phases = set.intersection(*(set(r.phases) for r in reports))
    fits = {}
    for ph in sorted(phases):
        a, b, _ = fit_line(xs, [r.phases[ph]["peak"] for r in reports])
        fits[ph] = (a, b)
    last = reports[-1]
    return BatchScaling(batches=tuple(xs), params_bytes=last.params_bytes, grads_bytes=last.grads_bytes,
                        optimizer_bytes=last.optimizer_bytes, activations_fixed_bytes=a_fix,
                        activations_per_sample_bytes=a_per, activations_fit_residual=a_res,
                        temporaries_fixed_bytes=t_fix, temporaries_per_sample_bytes=t_per, phase_fits=fits,
                        method=last.method)


def second_batch(batch: int) -> int:
    """The other micro-batch size for a two-point fit: double small ones, halve large ones."""
    return batch * 2 if batch <= 2 else batch // 2


def fit_batch_scaling(cfg: RunConfig, *, batches: Sequence[int] | None = None, method: str = "estimate",
                      reports: Sequence[MemoryReport] = ()) -> BatchScaling:
    """Report the run at several micro-batch sizes and fit the linear model.

    Args:
        cfg: the run configuration.
        batches: micro-batch sizes (default: ``cfg.micro_batch`` and :func:`second_batch` of it).
        method: "estimate" (fake tensors) or "measure" (real step).
        reports: reports already made for this run (their sizes are not redone).
    """
    if method not in ("estimate", "measure"):
        raise ConfigError("method", method, ("estimate", "measure"))
    if batches is None:
        b = cfg.micro_batch if isinstance(cfg.micro_batch, int) else 1
        batches = (b, second_batch(b))
    fn = estimate_memory if method == "estimate" else measure_memory
    done = {r.batch: r for r in reports}
    todo = [b for b in dict.fromkeys(batches) if b not in done]
    if len(todo) < len(set(batches)):
        log.debug("memory: batch scaling from the reports already made at micro-batches %s",
                  ", ".join(str(b) for b in dict.fromkeys(batches) if b not in todo))
    verb = "estimating micro-batch" if method == "estimate" else "measuring micro-batch"
    with stage("memory", len(todo), verb=verb, log=log) as said:  # each report's own lines are debug
        for b in todo:
            said.step(f"{b} of {', '.join(map(str, batches))}, for the batch scaling")
            done[b] = fn(cfg, batch=b)
    return scaling_from_reports([done[b] for b in batches])
