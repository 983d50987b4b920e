"""Diagnosis and ordered advice from a step-time profile (pure: no torch).

Order matters: adding devices to a run whose device waits for data, or runs kernels too
small to fill it, multiplies the waste. So the advice is (a) the input pipeline when the
data-wait share is above a threshold, (b) a larger micro-batch when throughput still rises
with it, (c) another precision when the chosen one's steps are measurably slower than one that
needs no more memory, (d) only then communication and scale-out, with predicted speed-ups. Each
item carries the measured figure that triggered it.

Within the input pipeline, the fix for data read from text files comes first: a raw
``--data`` job tokenizes each document in the loader (``raw-on-the-fly``: in ``__getitem__``, per
micro-batch; ``raw-packed``: all of it when the run starts), so the cheapest cure is to tokenize once
with ``trainfit prepare`` and read rows from its memory-mapped file (one read per micro-batch); only
then more loader workers (their count from the CPUs, bounded by ``config.MAX_WORKERS``), then pinned
memory on CUDA. Generated data has no file to prepare, so its advice starts at the workers.

Why precision sits third: a slower precision is a per-device fix that costs nothing (the same
devices, the same memory), so it comes before buying devices; but the input pipeline and the batch
size are cheaper to check and usually the larger effect, so they come first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from trainfit.config import MAX_WORKERS
from trainfit.errors import check_number
from trainfit.vocabulary import PRECISIONS, Dtype, PrecisionName, precision_facts

BOTTLENECKS = ("input", "batch", "communication", "compute")

PRECISION_SLOWER_THRESHOLD = 1.5
"""Advise another precision when the chosen one's median step takes more than this many times the
other's. Step-time noise on a shared CPU is up to ~30% between alternating steps, so a ratio of
1.5 separates a real kernel gap (no fast fp16 matmul: tens of times slower) from noise."""


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    input_frac: float = 0.10
    """Data-wait share of the step above which the run is input-bound."""
    batch_gain: float = 0.15
    """Relative throughput gain at 2x micro-batch above which the run is batch-bound."""
    comm_frac: float = 0.20
    """Exposed-communication share of the step above which the run is communication-bound."""
    precision_ratio: float = PRECISION_SLOWER_THRESHOLD
    """Chosen / other precision's median step time above which the other is advised."""

    def __post_init__(self) -> None:
        for name in ("input_frac", "batch_gain", "comm_frac", "precision_ratio"):
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
    precision: str = ""
    """The profiled precision (empty: no precision advice)."""
    precision_times: Mapping[str, float] = field(default_factory=dict)
    """Median step seconds per precision measured side by side (the chosen one included); empty when
    not probed."""
    device_label: str = ""
    """The device in words for the advice ("this CPU", "NVIDIA H200"); default: the device type."""
    data_source: str = "generated"
    """Where the task's rows come from (``GenericTask.data_source``): "generated", "prepared" (a
    ``trainfit prepare`` memmap), "raw-packed" or "raw-on-the-fly" (text tokenized by the loader)."""
    data: str = ""
    """The ``--data`` path as given (named in the ``trainfit prepare`` advice)."""
    cpu_count: int = 0
    """CPUs of this machine (``os.cpu_count()``); 0: unknown (the worker count is then doubled)."""


def bottleneck(f: Findings, t: Thresholds = Thresholds()) -> str:
    """input > batch > communication > compute: the first that applies."""
    if f.data_wait_frac > t.input_frac:
        return "input"
    if f.batch_gain is not None and f.batch_gain > t.batch_gain:
        return "batch"
    if f.world_size > 1 and f.comm_exposed_frac > t.comm_frac:
        return "communication"
    return "compute"


RAW_SOURCES = ("raw-on-the-fly", "raw-packed")
"""Data sources whose text is tokenized by the run itself: ``trainfit prepare`` does it once instead."""

MAX_SUGGESTED_WORKERS = 8
"""Most loader workers the advice suggests: past a handful, each more worker mostly adds memory and start-up."""


def suggested_workers(current: int, cpu_count: int) -> int:
    """Loader workers to try: one per CPU left after the training process (at most
    ``MAX_SUGGESTED_WORKERS``), at least one more than ``current``; doubled when the CPUs are unknown
    or already all used; never above ``config.MAX_WORKERS`` (what a run may start)."""
    spare = min(MAX_SUGGESTED_WORKERS, cpu_count - 1) if cpu_count > 1 else 0
    n = spare if spare > current else max(2, 2 * current)
    return max(1, min(n, MAX_WORKERS))


def _prepare_advice(f: Findings, share: str) -> str:
    data = f.data or "PATH"
    how = ("tokenizes every document in the loader for each micro-batch" if f.data_source == "raw-on-the-fly"
           else "tokenizes the whole text at start-up and keeps it in memory")
    return (f"tokenize once with `trainfit prepare --data {data} --out DIR` and train on `--data DIR` "
            f"(one read of a memory-mapped file per micro-batch); this run {how} ({f.data_source}); {share}")


def _input_advice(f: Findings) -> list[dict]:
    share = f"data wait is {f.data_wait_frac:.0%} of the step"
    if f.data_source in RAW_SOURCES:  # text files: prepare, then workers from the CPUs, then pinned memory
        more = suggested_workers(f.loader_workers, f.cpu_count)
        cpus = f"; {f.cpu_count} CPUs here" if f.cpu_count else ""
        items = [_prepare_advice(f, share),
                 f"then raise loader_workers from {f.loader_workers} to {more} (`--loader-workers {more}`{cpus}): "
                 f"tokenizing then overlaps compute; {share}"]
        items.append(f"pin host memory (DataLoader pin_memory=True) so host-to-device copies run asynchronously"
                     f"{'' if f.device_type == 'cuda' else ' (applies on CUDA; this run is on ' + f.device_type + ')'}; "
                     f"{share}, host-to-device {f.h2d_frac:.0%}")
        kinds = ("prepare", "workers", "pin_memory")
        return [{"kind": "input", "text": s, "data_wait_frac": f.data_wait_frac, "fix": k,
                 **({"loader_workers": more} if k == "workers" else {})} for s, k in zip(items, kinds)]
    more = 2 if f.loader_workers == 0 else 2 * f.loader_workers
    items = [
        f"raise loader_workers from {f.loader_workers} to {more} (loading then overlaps compute); {share}",
        f"pin host memory (DataLoader pin_memory=True) so host-to-device copies run asynchronously"
        f"{'' if f.device_type == 'cuda' else ' (applies on CUDA; this run is on ' + f.device_type + ')'}; "
        f"{share}, host-to-device {f.h2d_frac:.0%}",
        f"prefetch more batches per worker (DataLoader prefetch_factor, default 2); {share}",
        f"make per-sample transforms cheaper: precompute them once, or batch them on the device; {share}",
    ]
    if f.data_source != "prepared":  # a prepared file is that format already
        items.append(f"store samples in a format read in one operation (a memory-mapped array or packed shards, "
                     f"not one file per sample); {share}")
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


def precision_memory(name: str) -> tuple[int, int, int]:
    """(model-state bytes per parameter, residual-stream bytes, matmul-input bytes per element) of a precision.

    From its vocabulary row, counted as ``plan.basis.analytic_basis`` counts them: a master copy's
    gradient is fp32 while stepping (so weights + 4 + master), and autocast keeps the residual stream
    in the weights' fp32 while matmul inputs are cast to the compute dtype. The optimizer's own state
    is the same for every precision.
    """
    w, g, master, cb = precision_facts(name).bytes_per_param
    return w + (4 if master else g) + master, 4 if w == 4 else 2, cb


def precision_candidates(chosen: str, supported: Iterable[str] | None = None) -> tuple[PrecisionName, ...]:
    """The other precisions needing no more memory than ``chosen`` in any part (and ``supported`` here).

    fp32 -> bf16-mixed, fp16-mixed (same weights, half activations; the ``*-true`` rows add a master
    copy and its fp32 gradient); a ``*-mixed`` -> the other ``*-mixed``; a ``*-true`` -> the other
    ``*-true`` (a ``*-mixed`` run keeps an fp32 residual stream, fp32 needs more of everything).
    """
    mine = precision_memory(chosen)
    ok = None if supported is None else {PrecisionName(p) for p in supported}
    return tuple(p for p in PRECISIONS if p != PrecisionName(chosen) and (ok is None or p in ok)
                 and all(a <= b for a, b in zip(precision_memory(p), mine)))


def fmt_ratio(r: float) -> str:
    """``57x``, ``2.3x``."""
    return f"{r:.0f}x" if r >= 10 else f"{r:.1f}x"


def _slow_cause(chosen: str, other: str, device_type: str) -> str:
    mine, theirs = precision_facts(chosen).compute, precision_facts(other).compute
    if mine == theirs:
        return f"both compute in {mine}; {chosen}'s weight casts, master copy or loss scaling cost the difference"
    if device_type == "cpu" and mine in (Dtype.FP16, Dtype.BF16):
        return f"no fast {mine} matmul here"
    return f"{theirs} matmuls run faster than {mine} ones here"


def _precision_advice(f: Findings, t: Thresholds) -> list[dict]:
    """At most one item: the fastest measured candidate, when the chosen precision is ``t.precision_ratio`` slower.

    Only ``precision_candidates`` count (the measured times of others are ignored), so the advice never
    trades memory for speed.
    """
    times = f.precision_times
    mine = times.get(f.precision) if f.precision else None
    allowed = precision_candidates(f.precision) if f.precision else ()
    others = {p: s for p, s in times.items() if p in allowed and s > 0}
    if not mine or not others:
        return []
    best = min(others, key=others.get)
    ratio = mine / others[best]
    if not ratio > t.precision_ratio:
        return []
    same = precision_memory(best) == precision_memory(f.precision)
    text = (f"{f.precision} steps take {fmt_ratio(ratio)} {best} on {f.device_label or f.device_type} "
            f"({mine * 1e3:,.1f} ms vs {others[best] * 1e3:,.1f} ms per step, alternating): "
            f"{_slow_cause(f.precision, best, f.device_type)}; use {best} "
            f"({'the same memory' if same else 'less activation memory'})")
    return [{"kind": "precision", "text": text, "precision": f.precision, "suggested_precision": str(best),
             "ratio": ratio, "step_s": dict(times)}]


def advise(f: Findings, t: Thresholds = Thresholds()) -> tuple[str, list[dict]]:
    """(bottleneck, ordered advice items). Each item is ``{"kind", "text", ...measured figures}``.

    Order: input, batch, precision, communication, scale-out (the module docstring says why).
    """
    b = bottleneck(f, t)
    items: list[dict] = []
    if f.data_wait_frac > t.input_frac:
        items += _input_advice(f)
    if f.batch_gain is not None and f.batch_gain > t.batch_gain and f.micro_batch:
        items += _batch_advice(f)
    # After the input and the batch (cheaper to check, usually larger), before communication and
    # scale-out (a slower precision is a free per-device fix; more devices cost money).
    precision = _precision_advice(f, t)
    items += precision
    if f.world_size > 1 and f.comm_exposed_frac > t.comm_frac:
        items.append({"kind": "communication", "comm_exposed_frac": f.comm_exposed_frac,
                      "text": f"exposed communication is {f.comm_exposed_frac:.0%} of the step: raise accumulation "
                              "or micro_batch to amortise each gradient sync, prefer ddp/zero2 over zero3 "
                              "(1.5x the traffic), or use a faster interconnect"})
    if f.scaling_note:
        prefix = "" if b in ("compute", "communication") and not precision else "after the fixes above: "
        items.append({"kind": "scale-out", "text": prefix + f.scaling_note})
    return b, items
