"""Where each step's time goes: the step-time breakdown, throughput, MFU and ordered advice.

``profile(run, options)`` runs warm-up + N real optimizer steps through the same
``run.step`` that training uses, with a :class:`~trainfit.meters.timers.PhaseTimer`
threaded through it and the strategy's collectives wrapped in a ``comm`` phase; the step does
not know it is measured. Phases:

- ``data_wait``: host time blocked on the loader (``next(batches)``)
- ``h2d``: host-to-device copy of the micro-batches
- ``forward`` / ``backward`` (incl. recompute) / ``optimizer`` (unscale, clip, step, zero)
- ``comm_exposed``: time blocked in the step's explicit collectives (token count, loss,
  overflow flag) plus the *exposed* part of the gradient sync. DDP/FSDP sync gradients inside
  the last micro-batch's backward, partly hidden behind it; with accumulation >= 2 the exposed
  part is that backward minus a non-syncing micro-batch's backward (same work, no sync).
  With accumulation 1 it cannot be separated and stays in ``backward`` (reported as such).
- ``rest``: everything else (loss read-back, Python, the timer itself).

On CUDA, phases are timed with CUDA events and the device busy fraction comes from the
kernel timeline of ``torch.profiler``; on CPU phases are wall-clock and ``busy_frac`` is the
share of the step spent computing (h2d + forward + backward + optimizer).

With ``precision_probe`` it also steps the same model in the other precisions this device supports
that need no more memory (``advice.precision_candidates``), alternating with the chosen one, so the
advice can say when the chosen precision is the slow part (``advice.PRECISION_SLOWER_THRESHOLD``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import trainfit.logs as logs
import trainfit.progress as progress
from trainfit.data import make_loader
from trainfit.errors import ConfigError, check_int, check_number
from trainfit.levers.checkpointing import CheckpointPolicy, NoCheckpointing, apply_checkpointing
from trainfit.meters import devices as hardware
from trainfit.meters.flops import FlopCounter
from trainfit.meters.timers import PhaseTimer
from trainfit.probes import scaleout
from trainfit.probes.advice import PRECISION_SLOWER_THRESHOLD, Findings, Thresholds, advise, precision_candidates
from trainfit.probes.batchfit import scaling_from_reports
from trainfit.probes.memory import measure_memory
from trainfit.results import Advice, BatchProbe, MemoryReport, ProfileReport
from trainfit.run import Run, build_run
from trainfit.tasks.base import to_device
from trainfit.units import fmt_bytes
from trainfit.vocabulary import PRECISIONS, Dtype, PrecisionName

log = progress.logger("profile")

PARTS = ("data_wait_s", "h2d_s", "forward_s", "backward_s", "optimizer_s", "comm_exposed_s", "rest_s", "step_s")


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    steps: int = 20
    """Profiled optimizer steps (after warm-up)."""
    warmup: int = 3
    """Steps run first and discarded (allocator, loader workers, lazy init)."""
    batch_probe: bool = True
    """Also profile a 2x micro-batch to tell whether throughput still rises with it."""
    bandwidth_bytes_per_s: float | None = None
    """Interconnect bandwidth for scale-out predictions; None: measure (CPU loopback, or the live
    process group) or, on a single GPU, report no prediction."""
    latency_s: float | None = None
    """Per ring-step latency; None: measured with the bandwidth, else 0."""
    overlap: float = 0.0
    """Fraction of backward that can hide communication in predictions (0: pessimistic)."""
    trace_dir: str | None = None
    """Write a torch.profiler Chrome trace of a few extra steps here."""
    precision_probe: bool = False
    """Also step the same model in the other precisions this device supports that need no more memory,
    alternating with the chosen one, and advise when the chosen one is slower. Off here, so callers that
    profile many configurations (scripts, tests) pay for it only when asked; ``trainfit profile`` turns it
    on (``--no-precision-probe`` turns it off)."""
    precision_steps: int = 3
    """Timed steps per precision in that probe, after one warm-up step of each other precision."""
    thresholds: Thresholds = dataclasses.field(default_factory=Thresholds)

    def __post_init__(self) -> None:
        check_int("steps", self.steps, minimum=1)
        check_int("warmup", self.warmup, minimum=0)
        check_int("precision_steps", self.precision_steps, minimum=1)
        check_number("overlap", self.overlap, minimum=0.0, inclusive=True)
        if self.overlap > 1:
            raise ConfigError("overlap", self.overlap, "a number in [0, 1]")
        if self.bandwidth_bytes_per_s is not None:
            check_number("bandwidth", self.bandwidth_bytes_per_s, minimum=0.0)


class TimedStrategy:
    """The run's strategy with its explicit collectives inside a ``comm`` phase."""

    def __init__(self, inner, timer: PhaseTimer) -> None:
        self._inner, self._timer = inner, timer
        self.calls = 0
        """Explicit collectives called (also counted on one device, where they are no-ops)."""

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        self.calls += 1
        with self._timer.phase("comm"):
            self._inner.all_reduce_sum(t)

    def all_reduce_max(self, t: torch.Tensor) -> None:
        self.calls += 1
        with self._timer.phase("comm"):
            self._inner.all_reduce_max(t)


def _split_sync(ph: dict[str, float], accumulation: int, world_size: int) -> tuple[float, float]:
    """(backward_s, exposed gradient-sync s) from the non-syncing and syncing backward phases."""
    nosync, sync = ph.get("backward", 0.0), ph.get("backward_sync", 0.0)
    if world_size == 1 or accumulation < 2:
        return nosync + sync, 0.0
    exposed = max(0.0, sync - nosync / (accumulation - 1))
    return nosync + sync - exposed, exposed


def run_steps(run: Run, batches, *, steps: int, warmup: int, flops: FlopCounter | None = None,
              said: bool = False) -> list[dict]:
    """Warm-up + ``steps`` timed optimizer steps; one dict of seconds (and counts, FLOPs) per step. ``said``: each
    step is said on the ``trainfit.profile`` logger (``profile: step 3/13 (timed) ...``, rate-limited).

    A step that ran accepts the job (``trainfit.logs.accept``: a held stderr prints and writes through)."""
    st = run.strategy
    timer = PhaseTimer(st.device)
    timed = TimedStrategy(st, timer)
    rows = []
    with progress.stage("profile", warmup + steps, verb="step", log=log) if said else contextlib.nullcontext() as s:
        for i in range(warmup + steps):
            if said:
                s.step("warm-up" if i < warmup else "timed")
            rows.extend(_one_step(run, batches, timer, timed, flops, timed_step=i >= warmup))
            logs.accept()  # a step ran: the job is accepted
    return rows


def _one_step(run: Run, batches, timer: PhaseTimer, timed: TimedStrategy, flops: FlopCounter | None, *,
              timed_step: bool) -> list[dict]:
    """One step of :func:`run_steps`: its row, or none for a warm-up step."""
    st, cfg = run.strategy, run.cfg
    timed.calls = 0
    t0 = time.perf_counter()
    host = [next(batches) for _ in range(cfg.accumulation)]  # blocks on the loader
    t1 = time.perf_counter()
    with timer.phase("h2d"):
        mbs = [to_device(mb, st.device) for mb in host]
    res = run.step(mbs, timer=timer, strategy=timed)
    ph = timer.collect()  # CUDA: synchronizes
    t2 = time.perf_counter()
    if not timed_step:
        return []
    backward, hidden_sync = _split_sync(ph, cfg.accumulation, st.world_size)
    row = {"data_wait_s": t1 - t0, "h2d_s": ph.get("h2d", 0.0), "forward_s": ph.get("forward", 0.0),
           "backward_s": backward, "optimizer_s": ph.get("optimizer", 0.0),
           "comm_exposed_s": ph.get("comm", 0.0) + hidden_sync, "step_s": t2 - t0,
           "comm_explicit_s": ph.get("comm", 0.0), "grad_sync_exposed_s": hidden_sync,
           "count": res.count / st.world_size, "samples": sum(_batch_len(mb) for mb in host),
           "collectives": timed.calls}
    row["rest_s"] = max(0.0, row["step_s"] - sum(row[k] for k in PARTS[:-2]))
    f = flops.step(host) if flops is not None else None  # outside the timed window; cached by shape
    if f is not None:
        row["model_flops"], row["hardware_flops"] = f.model_flops, f.hardware_flops
    return [row]


def task_flop_counter(task, policy: CheckpointPolicy) -> FlopCounter:
    """A FLOP counter for ``task``'s model under ``policy`` (its recompute counted as hardware FLOPs)."""
    if isinstance(policy, NoCheckpointing):
        return FlopCounter(build_model=task.build_model, loss_fn=task.loss)
    return FlopCounter(build_model=task.build_model, loss_fn=task.loss,
                       recompute=lambda m: apply_checkpointing(m, policy, task.block_names(m)))


def _batch_len(batch) -> int:
    for leaf in torch.utils._pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def _spread(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "p25": q[0], "p75": q[2], "min": min(values), "max": max(values)}


def data_source(task) -> str:
    """Where ``task``'s rows come from (``GenericTask.data_source``; "generated" for a task without files)."""
    return str(getattr(task, "data_source", "generated"))


def step_batches(run: Run, micro_batch: int, start_step: int = 0):
    """An iterator over this rank's micro-batches from ``start_step`` on (the run's loader settings)."""
    cfg, st = run.cfg, run.strategy
    return iter(make_loader(run.task.dataset(), run.task.collate, start_step=start_step, micro_batch=micro_batch,
                            accumulation=cfg.accumulation, rank=st.rank, world_size=st.world_size, seed=cfg.seed,
                            workers=cfg.loader_workers, pin_memory=st.device.type == "cuda"))


def _peak(run: Run) -> tuple[float | None, str, str]:
    """(peak FLOP/s, dtype, source) for MFU on this run's device; None when unknown."""
    dev = run.strategy.device
    tf32 = dev.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    dtype = hardware.compute_dtype(run.cfg.precision, tf32_enabled=tf32)
    if dev.type == "cpu":
        cal = hardware.calibrate_cpu(dtype)
        return cal.flops_per_s, dtype, f"{cal.source}; {cal.size}x{cal.size} {dtype}, {cal.threads} threads"
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        row = hardware.find_device(name)
        peak = hardware.peak_flops(name, dtype)
        if peak is None:
            return None, dtype, f"device {name!r} ({dtype}) is not in the peak table: MFU not reported"
        return peak, dtype, row.source
    return None, dtype, f"no peak FLOP/s known for device type {dev.type!r}"


def _timeline(run: Run, batches, steps: int, trace_dir: str | None) -> tuple[float | None, str | None]:
    """(device busy fraction, trace path) from ``torch.profiler`` over ``steps`` extra steps.

    The busy fraction is the union of CUDA kernel intervals over the steps' wall time (None on
    CPU); the Chrome trace is written only when ``trace_dir`` is given.
    """
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    cuda = run.strategy.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with tprofile(activities=acts) as prof:
        t0 = time.perf_counter()
        run_steps(run, batches, steps=steps, warmup=0)
        wall_us = (time.perf_counter() - t0) * 1e6
    trace = None
    if trace_dir:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        trace = str(Path(trace_dir) / f"trace-rank{run.strategy.rank}.json")
        prof.export_chrome_trace(trace)
    if not cuda:
        return None, trace
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for s, e in spans:  # union of kernel intervals
        if e > end:
            busy += e - max(s, end)
            end = e
    return min(1.0, busy / wall_us), trace


def _rate(rows: list[dict]) -> float:
    """Compute throughput per device: items per second of step time without data wait."""
    return sum(r["count"] for r in rows) / max(sum(r["step_s"] - r["data_wait_s"] for r in rows), 1e-12)


def _probe_batch(run: Run, opts: ProfileOptions) -> tuple[float | None, tuple | None, str]:
    """Throughput gain at 2x micro-batch (same model, optimizer and accumulation).

    Steps at m and 2m alternate, so a change in machine load hits both alike; the rates are
    medians of per-step compute throughput (data wait excluded).
    """
    m = run.cfg.micro_batch
    small, big = step_batches(run, m, start_step=10_000), step_batches(run, 2 * m, start_step=20_000)
    r_small, r_big = [], []
    try:
        run_steps(run, big, steps=1, warmup=1)
        for _ in range(max(3, opts.steps // 2)):
            r_small.append(_rate(run_steps(run, small, steps=1, warmup=0)))
            r_big.append(_rate(run_steps(run, big, steps=1, warmup=0)))
    except torch.OutOfMemoryError:
        return None, None, f"micro_batch={2 * m} ran out of memory"
    r1, r2 = statistics.median(r_small), statistics.median(r_big)
    return r2 / r1 - 1.0, (r1, r2), f"alternating steps at micro_batch={m} and {2 * m}"


def supported_precisions(device: torch.device) -> tuple[PrecisionName, ...] | None:
    """The precisions ``device`` runs (None where this probe does not know: then it does not probe).

    A CPU runs bf16 and fp16 (fp16 perhaps without fast kernels: that is what the probe measures); a CUDA
    device runs bf16 only where it has bf16 arithmetic (compute capability 8.0 on), not emulated.
    """
    if device.type == "cpu":
        return tuple(PRECISIONS)
    if device.type == "cuda":
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return tuple(p for p, f in PRECISIONS.items() if bf16 or f.compute != Dtype.BF16)
    return None


def device_label(device: torch.device) -> str:
    """The device in words for advice: "this CPU", or the CUDA device's name."""
    if device.type == "cpu":
        return "this CPU"
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


PRECISION_WARMUP = 1
"""Untimed steps of each other precision first (its kernels, allocator and lazy init); the chosen run is
already warm from the profile."""


def _compute_s(run: Run, host: list) -> float:
    """One optimizer step of ``run`` on the host micro-batches ``host``: seconds without data wait."""
    row = run_steps(run, itertools.cycle(host), steps=1, warmup=0)[0]
    return row["step_s"] - row["data_wait_s"]


WARMUP_CLEAR = 4.0
"""A candidate whose one warm-up micro-batch takes this many times the chosen precision's steady time per
micro-batch is taken as not faster without full steps (eager warm-ups here run 1-2x a steady step)."""


def probe_precision(run: Run, opts: ProfileOptions) -> tuple[dict[str, float], str]:
    """({precision: median step seconds}, how) for the chosen precision and each candidate.

    Candidates are ``advice.precision_candidates`` of the chosen precision on this device: the same
    model, optimizer, micro-batch, accumulation and checkpointing, built one at a time (one extra model
    in memory at once). Each candidate runs one warm-up step, then steps alternate chosen / candidate on
    the same micro-batches, so a change in machine load hits both alike; times exclude data wait.

    A pair stops early once the ratio is clear either way: step-time noise is up to ~30% a step, so a
    candidate no faster than the chosen precision (ratio <= 1) cannot be ``PRECISION_SLOWER_THRESHOLD``
    faster, and one more than twice that faster cannot be below it. That keeps the probe to a couple of
    steps when one precision has no fast kernels here (tens of times slower).
    """
    cfg = run.cfg
    chosen = str(cfg.precision)
    candidates, why_none = _precision_candidates_here(run, chosen)
    if not candidates:
        return {}, why_none
    batches = step_batches(run, cfg.micro_batch, start_step=30_000)
    host = [next(batches) for _ in range(cfg.accumulation)]
    del batches
    mine: list[float] = []
    times: dict[str, float] = {}
    notes: list[str] = []
    said = progress.Stage(log, "profile", len(candidates), verb="precision probe", every_s=1.0)
    for p in candidates:
        said.step(f"{p} against {chosen}, steps in turn")
        pair = _probe_one_precision(run, p, chosen, host, opts, notes)
        if pair is None:
            continue
        pair_mine, pair_other = pair
        mine += pair_mine
        times[str(p)] = statistics.median(pair_other)
        notes.append(f"{p}: {len(pair_other)} step(s)")
    if not times:
        return {}, "; ".join(notes)
    times = {chosen: statistics.median(mine), **times}
    return times, (f"{chosen} alternating with {', '.join(map(str, candidates))} (each in turn) on the same micro-batches "
                   f"after {PRECISION_WARMUP} warm-up step, up to {opts.precision_steps} steps each, stopped "
                   f"once the ratio is clear ({'; '.join(notes)}); data wait excluded")


def _precision_candidates_here(run: Run, chosen: str) -> tuple[tuple[PrecisionName, ...], str]:
    """(the precisions to step against ``chosen`` on this run's device, why there are none when empty)."""
    st = run.strategy
    if st.world_size > 1:
        return (), (f"not probed on {st.world_size} ranks (profile with strategy=single to compare "
                    "precisions on one device)")
    supported = supported_precisions(st.device)
    if supported is None:
        return (), f"not probed: which precisions a {st.device.type} device runs is not known here"
    candidates = precision_candidates(chosen, supported)
    if not candidates:
        return candidates, f"no other precision that {st.device.type} supports needs no more memory than {chosen}"
    return candidates, ""


def _probe_one_precision(run: Run, p: PrecisionName, chosen: str, host: list, opts: ProfileOptions,
                         notes: list[str]) -> tuple[list[float], list[float]] | None:
    """(``run``'s step seconds in its precision ``chosen``, ``p``'s) alternating on ``host``, with ``p``'s run built
    next to ``run`` and freed after; None, with the reason added to ``notes``, when ``p`` was not timed."""
    st = run.strategy
    other = None
    try:
        other = build_run(dataclasses.replace(run.cfg, precision=p), strategy=st)
        if not _warms_up_in_time(run, other, host, p, chosen, notes):
            return None
        for _ in range(PRECISION_WARMUP):
            _compute_s(other, host)
        return _alternate_steps(run, other, host, opts.precision_steps)
    except ConfigError as e:
        notes.append(f"{p} not run ({e})")
        return None
    except torch.OutOfMemoryError:
        notes.append(f"{p} ran out of memory next to the {chosen} run")
        return None
    finally:
        del other
        if st.device.type == "cuda":
            torch.cuda.empty_cache()


def _warms_up_in_time(run: Run, other: Run, host: list, p: PrecisionName, chosen: str, notes: list[str]) -> bool:
    """Whether ``other`` (precision ``p``) may be faster than ``run`` (precision ``chosen``), from a first warm-up
    on one micro-batch. When even that takes WARMUP_CLEAR x the chosen precision's time per micro-batch, the
    candidate is not faster (a warm-up is at most a few times a steady step), so its full steps -- tens of times
    slower where a dtype has no fast kernel -- are not run (a note says so: no steady time to report for it)."""
    mine_first = _compute_s(run, host) / len(host)
    warm = _compute_s(other, host[:1])
    if warm > WARMUP_CLEAR * mine_first:
        notes.append(f"{p}: its warm-up micro-batch took {warm * 1e3:,.0f} ms, {warm / mine_first:,.0f}x "
                     f"{chosen}'s steady time per micro-batch, so it is not faster; no full step run")
        return False
    return True


def _alternate_steps(run: Run, other: Run, host: list, steps: int) -> tuple[list[float], list[float]]:
    """Up to ``steps`` steps of ``run`` and ``other`` in turn on ``host``: their seconds, stopped once the ratio
    is clear (``other`` no faster, or more than twice ``PRECISION_SLOWER_THRESHOLD`` faster)."""
    pair_mine: list[float] = []
    pair_other: list[float] = []
    for _ in range(steps):
        pair_mine.append(_compute_s(run, host))
        pair_other.append(_compute_s(other, host))
        ratio = statistics.median(pair_mine) / statistics.median(pair_other)
        if ratio <= 1.0 or ratio > 2 * PRECISION_SLOWER_THRESHOLD:
            break
    return pair_mine, pair_other


def _budget(run: Run) -> tuple[int | None, str]:
    if run.cfg.memory_cap:
        return run.cfg.memory_cap, "memory_cap"
    dev = run.strategy.device
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory, f"{torch.cuda.get_device_name(dev)} memory"
    return None, ""


def _fit_micro_batch(run: Run, m: int, max_micro_batch: int = 1024) -> tuple[int | None, str]:
    """The largest micro-batch m*2^k whose measured memory report fits the budget.

    Uses the memory report (``trainfit.probes.memory.measure_memory``: a real step under the
    storage tracker, worst-case full-length batch): the reports at m and 2m give the batch scaling
    (``probes.batchfit``, the one linear fit of memory in the micro-batch), whose largest fitting
    micro-batch proposes a candidate, and measured peaks decide (doubled while the next fits, halved
    until one does). Without a budget (CPU without memory_cap) it suggests 2m, which just ran.
    """
    budget, what = _budget(run)
    if budget is None:
        return 2 * m, (f"micro_batch={2 * m} ran in this profile; no memory budget is known on "
                       f"{run.strategy.device.type} (set memory_cap to find the largest that fits)")
    limit = min(max_micro_batch, len(run.task.dataset()))

    # Two micro-batches show the peak of accumulation (grads held while the next backward runs);
    # more would only repeat it, at the cost of a tracked step each.
    cfg = dataclasses.replace(run.cfg, accumulation=min(run.cfg.accumulation, 2))

    def report(b: int) -> MemoryReport:
        return measure_memory(cfg, batch=b, run=run)

    def peak(b: int) -> int:
        return report(b).peak_bytes

    r1, r2 = report(m), report(2 * m)
    p1, p2 = r1.peak_bytes, r2.peak_bytes
    try:
        fitted = scaling_from_reports((r1, r2)).max_micro_batch(budget)
    except ConfigError:  # not even micro-batch 1 fits by the fit: the measured peaks below decide
        fitted = 0
    cand = m
    while cand * 2 <= min(limit, fitted):
        cand *= 2
    # The extrapolation only proposes; measured peaks decide: climb while the next doubling
    # fits, or halve until one does.
    p = peak(cand) if cand > m else budget + 1
    if p <= budget:
        while cand * 2 <= limit and (p_next := peak(cand * 2)) <= budget:
            cand, p = cand * 2, p_next
        return cand, (f"measured peak {fmt_bytes(p)} at micro_batch={cand} fits {what} "
                      f"{fmt_bytes(budget)} (memory report)")
    while cand > m:
        cand //= 2
        if cand > m and (p := peak(cand)) <= budget:
            return cand, (f"measured peak {fmt_bytes(p)} at micro_batch={cand} fits {what} "
                          f"{fmt_bytes(budget)} (memory report)")
    if p2 <= budget:
        return 2 * m, f"measured peak {fmt_bytes(p2)} at micro_batch={2 * m} fits {what} (memory report)"
    return None, f"no larger micro-batch fits {what} {fmt_bytes(budget)} (memory report at {m}: {fmt_bytes(p1)})"


def profile(run: Run, options: ProfileOptions = ProfileOptions()) -> ProfileReport:
    """Profile ``run`` (from ``train.build_run``); ``.to_dict()`` of the report is ``trainfit profile --json``.

    In turn: the timed steps (after the one that compiles, under ``--compile``), the device's peak FLOP/s, the
    device timeline, the batch probe, the precision probe and the scale-out prediction; then the advice on them.
    """
    cfg = run.cfg
    if cfg.micro_batch == "auto":
        raise ConfigError("micro_batch", "auto", "a number for profiling", "pass --micro-batch N")
    flops = task_flop_counter(run.task, cfg.checkpointing)
    batches = step_batches(run, cfg.micro_batch)
    timed = _timed_steps(run, batches, options, flops)
    times = _StepTimes.of(timed.rows)
    peak = _peak(run)
    work = _StepFlops.of(timed.rows)
    busy, trace = _busy(run, batches, options, times.frac)
    batch = _batch_probe_and_fit(run, options)
    precision = _precision_probe_if_asked(run, options)
    scaling = _predict_scaling(run, options, timed.rows, times.med["backward_s"])
    advised = _advise_on(run, options, times.frac, batch, precision[0], scaling)
    return _report(run, options, timed=timed, times=times, peak=peak, work=work, flops=flops, busy=busy,
                   trace=trace, batch=batch, precision=precision, scaling=scaling, advised=advised)


@dataclass(frozen=True, kw_only=True)
class _Timed:
    """The profiled steps: a row per timed step, and what ``--compile`` cost."""

    rows: list[dict]
    first_s: float | None
    """Seconds of the first step, which compiled the graphs (None without ``--compile``)."""
    graphs: int | None
    """Graphs compiled by that first step."""
    recompiles: int | None
    """Graphs compiled during the warm-up and timed steps."""


def _timed_steps(run: Run, batches, options: ProfileOptions, flops: FlopCounter) -> _Timed:
    """The warm-up and timed steps; under ``--compile`` the first step, which compiles, is timed on its own first."""
    cfg = run.cfg
    first_s = graphs = None
    if run.compiled:
        progress.say(log, "profile: first step, which compiles the graphs (--compile) ...")
        first_s = run_steps(run, batches, steps=1, warmup=0)[0]["step_s"]
        graphs = run.compiled.graphs()
    progress.say(log, "profile: %d warm-up and %d timed steps of %s (micro-batch %s x accumulation %d) ...",
                 options.warmup, options.steps, cfg.model, cfg.micro_batch, cfg.accumulation)
    rows = run_steps(run, batches, steps=options.steps, warmup=options.warmup, flops=flops, said=True)
    recompiles = run.compiled.graphs() - graphs if run.compiled else None  # before the probes build other runs
    return _Timed(rows=rows, first_s=first_s, graphs=graphs, recompiles=recompiles)


@dataclass(frozen=True, kw_only=True)
class _StepTimes:
    """Where the timed steps' time went."""

    parts: dict[str, dict[str, float]]
    """Each part's spread over the steps (:func:`_spread`)."""
    med: dict[str, float]
    """Each part's median."""
    total_s: float
    """Seconds of all the timed steps."""
    frac: dict[str, float]
    """Each of :data:`PARTS`' share of ``total_s``."""

    @classmethod
    def of(cls, rows: list[dict]) -> _StepTimes:
        parts = {k: _spread([r[k] for r in rows]) for k in (*PARTS, "comm_explicit_s", "grad_sync_exposed_s")}
        total_s = sum(r["step_s"] for r in rows)
        return cls(parts=parts, med={k: v["median"] for k, v in parts.items()}, total_s=total_s,
                   frac={k: sum(r[k] for r in rows) / total_s for k in PARTS})


@dataclass(frozen=True, kw_only=True)
class _StepFlops:
    """The FLOPs of the steps whose every batch shape was counted."""

    steps: int
    model: float
    """Median model FLOPs per step."""
    hardware: float
    """Median hardware FLOPs per step (recompute included)."""
    achieved: float
    """Model FLOP/s over those steps."""
    achieved_hw: float
    """Hardware FLOP/s over those steps."""

    @classmethod
    def of(cls, rows: list[dict]) -> _StepFlops:
        counted = [r for r in rows if "model_flops" in r]  # steps whose every batch shape was counted
        model_flops = statistics.median(r["model_flops"] for r in counted)
        hw_flops = statistics.median(r["hardware_flops"] for r in counted)
        counted_s = sum(r["step_s"] for r in counted)
        return cls(steps=len(counted), model=model_flops, hardware=hw_flops,
                   achieved=sum(r["model_flops"] for r in counted) / counted_s,
                   achieved_hw=sum(r["hardware_flops"] for r in counted) / counted_s)


def _busy(run: Run, batches, options: ProfileOptions, frac: dict[str, float]) -> tuple[float, str | None]:
    """(device busy fraction, trace path): from the device timeline on CUDA or when a trace is asked for (a few
    more steps); on CPU the share of the step spent computing."""
    busy, trace = (None, None)
    if run.strategy.device.type == "cuda" or options.trace_dir:
        progress.say(log, "profile: %d more steps under torch.profiler (device timeline%s) ...",
                     min(3, options.steps), ", trace written" if options.trace_dir else "")
        busy, trace = _timeline(run, batches, min(3, options.steps), options.trace_dir)
    if busy is None:  # CPU: share of the step spent computing
        busy = frac["h2d_s"] + frac["forward_s"] + frac["backward_s"] + frac["optimizer_s"]
    return busy, trace


@dataclass(frozen=True, kw_only=True)
class _BatchFindings:
    """What the batch probe found, and the micro-batch fitted to memory when a larger one was faster enough."""

    gain: float | None = None
    rates: tuple | None = None
    note: str = "not probed"
    suggested: int | None = None
    fit_note: str = ""


def _batch_probe_and_fit(run: Run, options: ProfileOptions) -> _BatchFindings:
    """The batch probe (when ``options.batch_probe``); when 2x the micro-batch is faster by more than the
    threshold, the largest micro-batch that fits memory (measured memory reports)."""
    m = run.cfg.micro_batch
    if not options.batch_probe:
        return _BatchFindings()
    progress.say(log, "profile: batch probe: steps at micro-batch %s and %s in turn ...", m, 2 * m)
    gain, rates, probe_note = _probe_batch(run, options)
    suggested, fit_note = None, ""
    if gain is not None and gain > options.thresholds.batch_gain:
        progress.say(log, "profile: the larger micro-batch is %.0f%% faster: fitting the micro-batch to memory "
                     "(measured memory reports) ...", 100 * gain)
        with progress.inner():  # each memory report's own lines are debug
            suggested, fit_note = _fit_micro_batch(run, m)
    return _BatchFindings(gain=gain, rates=rates, note=probe_note, suggested=suggested, fit_note=fit_note)


def _precision_probe_if_asked(run: Run, options: ProfileOptions) -> tuple[dict[str, float], str]:
    """:func:`probe_precision` when asked for and the run is eager; else no times, and why."""
    if options.precision_probe and run.compiled:  # each candidate would compile its own graphs first
        return {}, "not probed under --compile (each precision compiles its own graphs; compare eagerly)"
    if options.precision_probe:
        return probe_precision(run, options)
    return {}, "not probed"


def _predict_scaling(run: Run, options: ProfileOptions, rows: list[dict], backward_s: float) -> dict:
    """Scale-out curves (:func:`~trainfit.probes.scaleout.scaling`) from the timed steps' compute time."""
    progress.say(log, "profile: predicting scale-out (%s) ...", "bandwidth given"
                 if options.bandwidth_bytes_per_s is not None else "measuring the interconnect bandwidth")
    samples = [r["step_s"] - r["data_wait_s"] - r["comm_exposed_s"] for r in rows]  # per-step compute
    compute_s = statistics.median(samples)
    # On one process the accumulation window skips its token-count all-reduce; n > 1 ranks run it.
    collectives = max(r["collectives"] for r in rows) + (run.strategy.world_size == 1)
    return scaleout.scaling(run, options, compute_s, backward_s, samples, collectives)


def _advise_on(run: Run, options: ProfileOptions, frac: dict[str, float], batch: _BatchFindings,
               precision_times: dict[str, float], scaling: dict) -> tuple[str, list]:
    """(bottleneck, advice) from what the profile measured (:func:`~trainfit.probes.advice.advise`)."""
    cfg, st = run.cfg, run.strategy
    findings = Findings(data_wait_frac=frac["data_wait_s"], comm_exposed_frac=frac["comm_exposed_s"],
                        h2d_frac=frac["h2d_s"], loader_workers=cfg.loader_workers, device_type=st.device.type,
                        world_size=st.world_size, strategy=cfg.strategy, micro_batch=cfg.micro_batch,
                        batch_gain=batch.gain, rate_unit=run.task.unit, rates=batch.rates,
                        suggested_micro_batch=batch.suggested, fit_note=batch.fit_note,
                        scaling_note=scaleout.scaling_note(scaling), precision=str(cfg.precision),
                        precision_times=precision_times, device_label=device_label(st.device),
                        data_source=data_source(run.task), data=cfg.data, cpu_count=os.cpu_count() or 0)
    return advise(findings, options.thresholds)


def _report(run: Run, options: ProfileOptions, *, timed: _Timed, times: _StepTimes, peak: tuple,
            work: _StepFlops, flops: FlopCounter, busy: float, trace: str | None, batch: _BatchFindings,
            precision: tuple[dict[str, float], str], scaling: dict, advised: tuple[str, list]) -> ProfileReport:
    """The :class:`~trainfit.results.ProfileReport` of what :func:`profile` measured."""
    cfg, st = run.cfg, run.strategy
    rows, med, frac, total_s = timed.rows, times.med, times.frac, times.total_s
    peak_flops, dtype, peak_source = peak
    bottleneck, advice = advised
    unit = run.task.unit
    items_per_s = sum(r["count"] for r in rows) / total_s
    return ProfileReport(
        data_wait_frac=frac["data_wait_s"], data_wait_s=med["data_wait_s"], h2d_s=med["h2d_s"],
        forward_s=med["forward_s"], backward_s=med["backward_s"], optimizer_s=med["optimizer_s"],
        comm_exposed_s=med["comm_exposed_s"], rest_s=med["rest_s"], step_s=med["step_s"],
        busy_frac=busy, tokens_per_s=items_per_s if unit == "tokens" else None,
        samples_per_s=sum(r["samples"] for r in rows) / total_s,
        mfu=work.achieved / peak_flops if peak_flops else None,
        hfu=work.achieved_hw / peak_flops if peak_flops else None,
        bottleneck=bottleneck, advice=tuple(Advice.from_dict(a) for a in advice),
        unit=unit, per_device=True, parts=times.parts, fractions=frac,
        model_flops_per_step=work.model, hardware_flops_per_step=work.hardware,
        flops_counted_on=flops.device.type, flops_steps=work.steps,
        peak_flops=peak_flops, peak_dtype=dtype, peak_source=peak_source,
        batch_probe=BatchProbe(micro_batch=cfg.micro_batch, gain=batch.gain, rates_per_s=batch.rates,
                               note=batch.note, suggested_micro_batch=batch.suggested, fit=batch.fit_note),
        scaling=scaling, precision_probe=precision[0], precision_probe_note=precision[1],
        grad_sync_separable=st.world_size == 1 or cfg.accumulation >= 2,
        device=str(st.device), world_size=st.world_size, rank=st.rank, strategy=cfg.strategy,
        steps=options.steps, warmup=options.warmup, trace=trace, threads=torch.get_num_threads(),
        model=cfg.model, precision=str(cfg.precision), checkpointing=cfg.checkpointing.spec,
        accumulation=cfg.accumulation,
        compile_s=max(0.0, timed.first_s - med["step_s"]) if timed.first_s is not None else None,
        compile_graphs=timed.graphs, recompiles=timed.recompiles,
    )
