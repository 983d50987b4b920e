"""Diagnosis and ordered advice from a step-time profile (pure: no torch).

Order matters: adding devices to a run whose device waits for data, or runs kernels too
small to fill it, multiplies the waste. So the advice is (a) the input pipeline when the
data-wait share is above a threshold, (b) a larger micro-batch when throughput still rises
with it, (c) only then scale-out, with predicted speed-ups. Each item carries the measured
figure that triggered it.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.errors import check_number

BOTTLENECKS = ("input", "batch", "communication", "compute")


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    input_frac: float = 0.10
    """Data-wait share of the step above which the run is input-bound."""
    batch_gain: float = 0.15
    """Relative throughput gain at 2x micro-batch above which the run is batch-bound."""
    comm_frac: float = 0.20
    """Exposed-communication share of the step above which the run is communication-bound."""

    def __post_init__(self) -> None:
        for name in ("input_frac", "batch_gain", "comm_frac"):
            check_number(name, getattr(self, name), minimum=0.0)


@dataclass(frozen=True, kw_only=True)
class Findings:
    """What the profile measured, as the diagnosis needs it."""

    data_wait_frac: float
    comm_exposed_frac: float
    h2d_frac: float
    loader_workers: int
    device_type: str
    world_size: int
    strategy: str
    micro_batch: int | None
    """None for micro_batch="auto"."""
    batch_gain: float | None = None
    """Throughput(2m) / throughput(m) - 1 with data wait excluded; None when not probed."""
    rate_unit: str = "tokens"
    rates: tuple[float, float] | None = None
    """Compute throughput per device at m and 2m."""
    suggested_micro_batch: int | None = None
    fit_note: str = ""
    """How the suggestion was checked against memory (budget, estimate, source)."""
    scaling_note: str = ""
    """One-line summary of the scale-out prediction (empty when it could not be made)."""


def bottleneck(f: Findings, t: Thresholds = Thresholds()) -> str:
    """input > batch > communication > compute: the first that applies."""
    if f.data_wait_frac > t.input_frac:
        return "input"
    if f.batch_gain is not None and f.batch_gain > t.batch_gain:
        return "batch"
    if f.world_size > 1 and f.comm_exposed_frac > t.comm_frac:
        return "communication"
    return "compute"


def _input_advice(f: Findings) -> list[dict]:
    share = f"data wait is {f.data_wait_frac:.0%} of the step"
    more = 2 if f.loader_workers == 0 else 2 * f.loader_workers
    items = [
        f"raise loader_workers from {f.loader_workers} to {more} (loading then overlaps compute); {share}",
        f"pin host memory (DataLoader pin_memory=True) so host-to-device copies run asynchronously"
        f"{'' if f.device_type == 'cuda' else ' (applies on CUDA; this run is on ' + f.device_type + ')'}; "
        f"{share}, host-to-device {f.h2d_frac:.0%}",
        f"prefetch more batches per worker (DataLoader prefetch_factor, default 2); {share}",
        f"make per-sample transforms cheaper: precompute them once, or batch them on the device; {share}",
        f"store samples in a format read in one operation (a memory-mapped array or packed shards, "
        f"not one file per sample); {share}",
    ]
    if f.loader_workers > 0:
        items.append(f"with workers on a busy host, each batch's tensors are handed over by file descriptor, "
                     f"which waits for the worker to be scheduled; torch.multiprocessing.set_sharing_strategy("
                     f"'file_system') avoids that round trip; {share}")
    return [{"kind": "input", "text": s, "data_wait_frac": f.data_wait_frac} for s in items]


def _batch_advice(f: Findings) -> list[dict]:
    m = f.micro_batch
    r1, r2 = f.rates or (float("nan"), float("nan"))
    measured = (f"{f.rate_unit}/s per device {r1:,.0f} at micro_batch={m}, {r2:,.0f} at {2 * m} "
                f"(+{f.batch_gain:.0%})")
    target = f.suggested_micro_batch or 2 * m
    return [{"kind": "batch", "text": f"raise micro_batch from {m} to {target}: {measured}; {f.fit_note}",
             "micro_batch": target, "batch_gain": f.batch_gain}]


def advise(f: Findings, t: Thresholds = Thresholds()) -> tuple[str, list[dict]]:
    """(bottleneck, ordered advice items). Each item is ``{"kind", "text", ...measured figures}``."""
    b = bottleneck(f, t)
    items: list[dict] = []
    if f.data_wait_frac > t.input_frac:
        items += _input_advice(f)
    if f.batch_gain is not None and f.batch_gain > t.batch_gain and f.micro_batch:
        items += _batch_advice(f)
    if f.world_size > 1 and f.comm_exposed_frac > t.comm_frac:
        items.append({"kind": "communication", "comm_exposed_frac": f.comm_exposed_frac,
                      "text": f"exposed communication is {f.comm_exposed_frac:.0%} of the step: raise accumulation "
                              "or micro_batch to amortise each gradient sync, prefer ddp/zero2 over zero3 "
                              "(1.5x the traffic), or use a faster interconnect"})
    if f.scaling_note:
        prefix = "" if b in ("compute", "communication") else "after the fixes above: "
        items.append({"kind": "scale-out", "text": prefix + f.scaling_note})
    return b, items
