"""What the pure planner is given, measured: bases from the memory probes, links from the device
table, compute rates and distributed overheads calibrated on this machine.

The planner's torch side: ``plan/`` never builds a model, steps a run or starts a process; this
probe does, and hands ``plan.search`` plain values (a :class:`~trainfit.plan.cost.Basis` per
(precision, checkpointing) pair, :class:`~trainfit.plan.cost.Links` per precision).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainfit.config import RunConfig, make_config
from trainfit.meters.devices import clock_facts
from trainfit.plan.clock import FLASH_BACKWARD, DeviceClock, gemm_seconds
from trainfit.plan.cost import Basis, Links, fit_dist_overhead
from trainfit.probes.compile import measure_compile_speedup
from trainfit.probes.estimate import BASIS_BATCHES
from trainfit.probes.fastbasis import BASIS_SOURCES, basis_provider, links_provider  # noqa: F401 -- re-exported
from trainfit.probes.fullbasis import report_basis  # noqa: F401 -- re-exported (its home since issue 29)
from trainfit.probes.memory import example_batch
from trainfit.run import build_run
from trainfit.strategies.launch import spawn_errors, spawn_local
from trainfit.tasks.base import to_device
from trainfit.vocabulary import (
    PRECISIONS,
    STRATEGIES,
    TORCH_DTYPE_NAMES,
    Dtype,
    PrecisionName,
    StrategyName,
    precision_facts,
)

log = logging.getLogger("trainfit.plan")
POINT_BUDGET_S = 2.0
"""Seconds of steps after which a calibration point stops repeating (it has at least one)."""
PAIR_BUDGET_S = 10.0
"""Seconds a precision's first three calibration points may take before its further checkpointing policies are
priced from that fit instead of stepped (:func:`calibrated_links`)."""
STEP_ANYWAY_S = 1.0
"""A precision whose calibration steps would take less than this (at its lower bound) is stepped even where it
cannot rank first: cheap, and its rows are then measured, not bounded (a small model's benchmarks keep every
precision measured)."""
STEPPED_SAMPLES = 20
"""Samples one pair's calibration steps at the least: (2,1), (4,1) and (2,2), each a warm-up and one measured step."""


def measure_step_s(cfg: RunConfig, *, reps: int = 5, clock: Callable[[], float] | None = None,
                   statistic: str = "min", budget_s: float | None = None) -> float:
    """Fastest of ``reps`` optimizer steps of ``cfg`` on worst-case (full-length) micro-batches, after
    one step that allocates the optimizer state. The minimum, not the median: on a shared machine the
    other processes only ever add time, and the fastest step is the one they disturbed least.
    ``clock`` defaults to wall time; ``time.thread_time`` with one torch thread measures the step's
    own CPU time, which other processes on a loaded machine barely change. ``statistic="median"``
    for steps of several processes: there every step waits for the slowest rank at each
    collective, and the step-to-step spread is intrinsic (2 gloo ranks on 2 cores: 14-35 ms for
    one zero1 step), so the median is the throughput a run sees and the minimum a lucky draw.
    ``budget_s``: stop repeating once the measured steps have taken this long (wall), at least one."""
    if statistic not in ("min", "median"):
        raise ValueError(f"statistic={statistic!r}: choose min or median")
    clock = clock or time.perf_counter
    run = build_run(cfg)
    mbs = [to_device(example_batch(run.task, cfg.micro_batch), run.strategy.device)] * cfg.accumulation
    times = []
    spent = 0.0
    for i in range(reps + 1):
        if budget_s is not None and len(times) >= 1 and spent >= budget_s:
            break
        t0, w0 = clock(), time.perf_counter()
        run.step(mbs)
        if i:
            times.append(clock() - t0)
            spent += time.perf_counter() - w0
    return min(times) if statistic == "min" else sorted(times)[len(times) // 2]


def measure_points(cfg: RunConfig, points: tuple[tuple[int, int], ...], *, reps: int = 5,
                   clock: Callable[[], float] | None = None, budget_s: float = POINT_BUDGET_S,
                   label: str = "") -> list[float]:
    """Fastest step of ``cfg`` at each (micro_batch, accumulation) of ``points``: :func:`measure_step_s` of each
    (a fresh run, one warm-up step, then up to ``reps`` steps, stopping once they have taken ``budget_s``; at
    least one: the measurement of the accuracy benchmarks, bounded). A tiny model gets its ``reps``; a model
    whose step takes seconds one step per point, not five.
    Each point is said on the ``trainfit.plan`` logger."""
    out = []
    for m, k in points:
        t0 = time.perf_counter()
        out.append(measure_step_s(make_config({"micro_batch": m, "accumulation": k}, base=cfg), reps=reps,
                                  clock=clock, budget_s=budget_s))
        log.info("plan: calibrating %s: micro-batch %d x accumulation %d: %.4g s (%.1f s with its warm-up)",
                 label or cfg.precision, m, k, out[-1], time.perf_counter() - t0)
    return out


PRICE_SHAPE = (256, 512, 1536)
"""(tokens, in features, out features) of the linear layer :func:`price_matmul` times: a transformer block's."""


def price_matmul(precision: str, *, seconds: float = 0.1, shape: tuple[int, int, int] = PRICE_SHAPE) -> float:
    """FLOP/s of one linear layer run as a step of ``precision`` runs it on this CPU: ``F.linear`` in the compute
    dtype, under CPU autocast for the mixed precisions (fp32 inputs and weight), with the current torch threads;
    the fastest of repeats over ``seconds`` (at least 3) after one warm-up.

    ``F.linear``, not ``torch.mm``: on this CPU a bf16/fp16 ``torch.mm`` of 256 x 256 takes a slow path (about 1.3
    GFLOP/s) while the same layer through ``F.linear`` reaches 12-17 GFLOP/s (oneDNN) -- a step's linear layers
    run the latter, so pricing by ``mm`` would make the half precisions look 10x slower than they step."""
    facts = precision_facts(precision)
    low = getattr(torch, TORCH_DTYPE_NAMES[facts.compute])
    tokens, k, n = shape
    held = torch.float32 if facts.autocast else low
    x, w = torch.randn(tokens, k, dtype=held), torch.randn(n, k, dtype=held)
    ctx = (torch.autocast("cpu", dtype=low) if facts.autocast else contextlib.nullcontext())
    with ctx:
        F.linear(x, w)
        best, start, reps = float("inf"), time.perf_counter(), 0
        while reps < 3 or time.perf_counter() - start < seconds:
            t0 = time.perf_counter()
            F.linear(x, w)
            best = min(best, time.perf_counter() - t0)
            reps += 1
    return 2.0 * tokens * k * n / best


def calibrated_links(base_cfg: RunConfig, plain: Callable[..., Links], basis: Callable[[str, str], Basis], *,
                     reps: int = 5, clock: Callable[[], float] | None = None,
                     precisions: tuple[str, ...] | None = None, screen: bool = True,
                     pair_budget_s: float = PAIR_BUDGET_S, point_budget_s: float = POINT_BUDGET_S,
                     notes: list[str] | None = None, price: Callable[[str], float] | None = None,
                     step_anyway_s: float = STEP_ANYWAY_S) -> Callable[[str, str], Links]:
    """Links whose compute rate and fixed costs are fitted to this model's measured steps.

    A small model runs far below the matmul peak (per-op overhead dominates), so on a CPU the
    FLOP rate alone mispredicts. Three measured steps per (precision, checkpointing) fit
    ``step_s = accumulation x (per_micro_batch_s + per_sample_s x micro_batch) + per_step_s``:
    t(2,1), t(4,1) and t(2,2) give per_sample_s, per_micro_batch_s and per_step_s.

    Bounded (issue 30), so a model whose step takes seconds answers in minutes:

    * ``screen``: every precision's matmul rate is priced first (:func:`price_matmul`, a linear layer as
      the step runs it, 0.1 s each; ``price`` replaces it). The precision with the fastest priced rate among
      ``precisions`` (default: all) is stepped first, as the reference. Another precision is stepped only if its rows
      could rank first -- its per-sample lower bound (its FLOPs at its priced matmul rate, which no step of
      it beats) is under the reference's per-sample upper bound (per sample + per micro-batch + per step:
      what a step of one sample costs per sample, the most any of its rows costs) -- and if its
      :data:`STEPPED_SAMPLES` calibration samples would take under ``pair_budget_s`` at that bound. Where
      they would take under ``step_anyway_s``, it is stepped whatever its bound (cheap; measured beats
      bounded). One that is not stepped is priced at its matmul rate with the reference's fixed costs -- a
      lower bound on its steps, and the note says so (measured here: a bf16-mixed gpt-small step of 2
      samples took 15 s, its bound 1.8 s: the half-precision backward runs far below the forward linear's
      rate on this CPU).
    * ``pair_budget_s``: where a precision's first fitted pair took longer than this to step, its other
      checkpointing policies are priced at that pair's fitted rate and fixed costs (their recompute
      FLOPs included), not stepped.
    * ``point_budget_s``: each point is stepped until it has ``reps`` steps or they have taken this long
      (:func:`measure_points`).

    Progress goes to ``logging.getLogger("trainfit.plan")`` at INFO; the notes (what was priced, not
    stepped, and why) are appended to ``notes`` when given and kept on the returned callable as
    ``links.notes`` for the caller to print.
    """
    calibration = _Calibration(
        base_cfg=base_cfg, plain=plain, basis=basis, reps=reps, clock=clock,
        order=tuple(precisions) if precisions is not None else tuple(PRECISIONS), screen=screen,
        pair_budget_s=pair_budget_s, point_budget_s=point_budget_s, notes=[] if notes is None else notes,
        price=price, step_anyway_s=step_anyway_s)

    def links(p: str, ck: str = "none") -> Links:
        return calibration.links(p, ck)

    links.notes = calibration.notes  # type: ignore[attr-defined]
    return links


@dataclass
class _Calibration:
    """The state behind one :func:`calibrated_links`: its settings, the links found so far (``cache``), each
    precision's first fit (``fitted``: checkpointing, FLOP/s, seconds its points took), the priced matmul rates
    and the notes already said."""

    base_cfg: RunConfig
    plain: Callable[..., Links]
    basis: Callable[[str, str], Basis]
    reps: int
    clock: Callable[[], float] | None
    order: tuple[str, ...]
    screen: bool
    pair_budget_s: float
    point_budget_s: float
    notes: list[str]
    price: Callable[[str], float] | None
    step_anyway_s: float
    cache: dict[tuple[str, str], Links] = field(default_factory=dict)
    fitted: dict[str, tuple[str, float, float]] = field(default_factory=dict)
    priced: dict[str, float] = field(default_factory=dict)
    said: set = field(default_factory=set)

    def priced_rate(self, p: str) -> float:
        """p's matmul rate, priced once (:func:`price_matmul` or ``price``) and said on the logger."""
        if p not in self.priced:
            self.priced[p] = (self.price or price_matmul)(p)
            log.info("plan: calibrating: %s matmuls priced at %.3g GFLOP/s on this CPU", p, self.priced[p] / 1e9)
        return self.priced[p]

    def reference(self) -> str:
        """The precision stepped first: the fastest priced matmul rate of ``order``."""
        return max(self.order, key=self.priced_rate)

    def note(self, text: str, key=None) -> None:
        """Say ``text`` once per ``key`` (default: the text): one line per precision, not per pair."""
        if (key or text) not in self.said:
            self.said.add(key or text)
            self.notes.append(text)
            log.info("plan: %s", text)

    def fit(self, p: str, ck: str) -> Links:
        """Three measured points of (p, ck) -> per-sample, per-micro-batch and per-step costs."""
        cfg = make_config({"precision": p, "checkpointing": ck, "micro_batch": 2, "accumulation": 1,
                           "strategy": StrategyName.SINGLE}, base=self.base_cfg)
        t21, t41, t22 = measure_points(cfg, ((2, 1), (4, 1), (2, 2)), reps=self.reps, clock=self.clock,
                                       budget_s=self.point_budget_s, label=f"{p}/{ck}")
        per_sample = max((t41 - t21) / 2, 1e-9)
        per_mb = max(t22 - t41, 0.0)
        per_step = max(t21 - per_mb - 2 * per_sample, 0.0)
        rate = self.basis(p, ck).hardware_flops_per_sample / per_sample
        self.fitted.setdefault(p, (ck, rate, t21 + t41 + t22))
        return dataclasses.replace(self.plain(p, ck), flops_per_s=rate, overhead_per_micro_batch_s=per_mb,
                                   per_step_s=per_step)

    def derived(self, p: str, ck: str) -> Links:
        """(p, ck) at the FLOP rate and fixed costs of p's fitted pair: its own FLOPs (the recompute
        checkpointing adds) priced at that pair's measured rate, no step taken."""
        first_ck, rate, cost = self.fitted[p]
        r = self.links(p, first_ck)
        self.note(f"calibration: {p} with checkpointing {ck} priced at {p}/{first_ck}'s fitted rate "
                  f"({rate / 1e9:.3g} GFLOP/s) and fixed costs, its recompute included, not stepped (that pair's "
                  f"three points took {cost:.0f} s, over the {self.pair_budget_s:g} s budget per pair)")
        return dataclasses.replace(self.plain(p, ck), flops_per_s=rate,
                                   overhead_per_micro_batch_s=r.overhead_per_micro_batch_s, per_step_s=r.per_step_s)

    def bounded(self, p: str, ck: str, ref: str) -> Links | None:
        """(p, ck) priced at p's matmul rate with ``ref``'s fixed costs, with a note saying why it is not stepped
        (its rows cannot rank first, or stepping it is over budget); None where it is to be stepped."""
        r = self.links(ref, ck)
        upper = (self.basis(ref, ck).hardware_flops_per_sample / r.flops_per_s + r.overhead_per_micro_batch_s
                 + r.per_step_s)
        lower = self.basis(p, ck).hardware_flops_per_sample / self.priced_rate(p)
        steps_s = STEPPED_SAMPLES * lower  # what its three points and warm-up would take at the least
        why = None
        if lower > upper and steps_s > self.step_anyway_s:
            why = (f"a sample costs it at least {lower:.3g} s against at most {upper:.3g} s in {ref}: none of its "
                   f"rows can rank first where a {ref} row fits")
        elif steps_s > self.pair_budget_s:
            why = (f"stepping it would take at least {steps_s:.0f} s, over the {self.pair_budget_s:g} s budget per "
                   "pair")
        if why is None:
            return None
        self.note(f"calibration: {p} not stepped: its matmuls run at {self.priced_rate(p) / 1e9:.3g} GFLOP/s on "
                  f"this CPU ({ref}: {self.priced_rate(ref) / 1e9:.3g}); with checkpointing {ck}, {why}; its rows "
                  f"are priced at that rate with {ref}'s fixed costs: a lower bound on their steps, not a measurement",
                  key=("skipped", p))
        return dataclasses.replace(self.plain(p, ck), flops_per_s=self.priced_rate(p),
                                   overhead_per_micro_batch_s=r.overhead_per_micro_batch_s, per_step_s=r.per_step_s)

    def links(self, p: str, ck: str = "none") -> Links:
        """(p, ck)'s links, found once: derived from p's fit past the pair budget, bounded where screening says
        it cannot rank first, else fitted to its measured steps."""
        if (p, ck) not in self.cache:
            self.cache[(p, ck)] = self._find(p, ck)
        return self.cache[(p, ck)]

    def _find(self, p: str, ck: str) -> Links:
        if p in self.fitted and self.fitted[p][2] > self.pair_budget_s:
            return self.derived(p, ck)
        ref = self.reference() if self.screen and p in self.order else p
        bounded = self.bounded(p, ck, ref) if ref != p else None
        return bounded if bounded is not None else self.fit(p, ck)


def compile_speedup_links(base_cfg: RunConfig, plain: Callable[..., Links], *, reps: int = 5,
                          measure: Callable[..., tuple[float, float, float]] | None = None) -> Callable[..., Links]:
    """``plain`` links with ``compile_speedup`` measured on this machine for each (precision, checkpointing)
    pair the search asks for: eager and compiled steps of the model at the basis' larger micro-batch,
    interleaved (``probes.compile.measure_compile_speedup``, median of ``reps``), once per pair."""
    measure = measure or measure_compile_speedup
    cache: dict[tuple[str, str], float] = {}

    def links(p: str, ck: str = "none") -> Links:
        if (p, ck) not in cache:
            cfg = make_config({"precision": p, "checkpointing": ck, "micro_batch": BASIS_BATCHES[1],
                               "accumulation": 1, "strategy": StrategyName.SINGLE}, base=base_cfg)
            eager_s, compiled_s, _ = measure(cfg, reps)
            cache[(p, ck)] = eager_s / compiled_s
        return dataclasses.replace(plain(p, ck), compile_speedup=cache[(p, ck)])

    return links


DIST_CALIBRATION = tuple((s.name, sync) for s in STRATEGIES.values() if s.distributed for sync in s.grad_sync_choices)
"""(strategy, grad_sync) pairs the CPU calibration measures: every distributed strategy, with each grad sync
its row allows (per-micro-batch sync only under FSDP2)."""
DIST_POINTS = ((2, 1), (2, 2), (2, 3))
"""(micro_batch, accumulation) each pair is measured at: three accumulations fit per-step and
per-micro-batch overhead by least squares (plan.cost.fit_dist_overhead)."""


def _dist_rank(rank: int, root, base: dict, pairs: tuple, points: tuple, reps: int) -> None:
    """Inside a rank of :func:`measure_dist_steps` (``strategies.launch.spawn_local``)."""
    base_cfg = make_config(base)

    def cfg_of(s: str, sync: str, mb: int, acc: int):
        return make_config({"strategy": s, "grad_sync": sync, "micro_batch": mb, "accumulation": acc}, base=base_cfg)

    # Warm-up: the first steps of a fresh process group run slow (connections, allocator, lazy
    # imports) -- measured: the first point came out slower than the same strategy at twice the batch.
    measure_step_s(cfg_of(*pairs[0], *points[-1]), reps=3)
    out = []
    for s, sync in pairs:
        for mb, acc in points:
            dist.barrier()
            out.append([s, sync, mb, acc, measure_step_s(cfg_of(s, sync, mb, acc), reps=reps, statistic="median")])
    (root / f"rank{rank}.json").write_text(json.dumps(out))


def measure_dist_steps(base_cfg: RunConfig, *, world: int = 2, pairs=DIST_CALIBRATION, points=DIST_POINTS,
                       reps: int = 15, timeout_s: float = 900) -> dict[tuple[str, str, int, int], float]:
    """Measure steps of each (strategy, grad_sync) at ``points`` on ``world`` gloo processes on this host.

    Spawns the ranks (``strategies.launch.spawn_local``: one torch thread each, file rendezvous);
    returns rank 0's median step per point (every rank waits for the slowest at each collective, so
    rank 0's time is the step's; the median, see ``measure_step_s``)."""
    values = {f: getattr(base_cfg, f) for f in ("model", "model_config", "seq_len", "optimizer", "seed")}
    root = tempfile.mkdtemp(prefix="trainfit-calib-")
    codes = spawn_local(_dist_rank, root, values, tuple(pairs), tuple(points), reps, world_size=world,
                        timeout_s=timeout_s, collective_timeout_s=300)
    result = Path(root, "rank0.json")
    if codes != [0] * world or not result.exists():
        raise RuntimeError(f"distributed calibration on {world} gloo processes did not finish (exit codes {codes}; "
                           f"a killed rank shows a negative code)\n{spawn_errors(root)}".rstrip())
    return {(s, sync, mb, acc): t for s, sync, mb, acc, t in json.loads(result.read_text())}


def with_dist_overhead(links: Callable[..., Links], base_cfg: RunConfig, basis: Callable[[str, str], Basis], *,
                       world: int = 2, strategies: tuple[str, ...] | None = None) -> tuple[Callable[..., Links], tuple]:
    """``links`` with ``dist_overhead`` fitted to steps measured on ``world`` gloo processes here.

    Measured once, in fp32 without checkpointing, and applied to every precision and checkpointing
    (the overhead is per collective and per FSDP unit, not per FLOP). Returns (links, rows)."""
    pairs = tuple(p for p in DIST_CALIBRATION if strategies is None or p[0] in strategies)
    if not pairs:
        return links, ()
    measured = measure_dist_steps(base_cfg, world=world, pairs=pairs)
    fp32 = PrecisionName.FP32
    rows = fit_dist_overhead(basis(fp32, "none"), links(fp32, "none"), n=world, measured=measured)

    def calibrated(p: str, ck: str = "none") -> Links:
        return dataclasses.replace(links(p, ck), dist_overhead=rows)

    return calibrated, rows


# -- CUDA: this device's GEMMs, memory and host link, measured (issue 30, item 4) ---------------------------------
GEMM_SHAPES = (("large", 8192, 8192, 8192), ("skinny", 256, 8192, 8192))
"""(name, m, n, k) of the GEMMs ``measure_device_timings`` times per dtype: a large square one (what a
transformer's weight GEMMs approach at a training batch) and a skinny one (few tokens: bandwidth-bound)."""
GEMM_DTYPES = (Dtype.BF16, Dtype.FP16, Dtype.FP32)
COPY_BYTES = 2**30
"""Device-to-device copy timed for HBM bandwidth: 1 GiB read and 1 GiB written."""
HOST_BYTES = 2**28
"""Pinned host <-> device copies timed for the host link: 256 MiB each way."""
LAUNCH_SHAPE = 64
"""A GEMM this small is all fixed cost: back to back, its time per call is the kernel's launch and ramp-up."""
ATTENTION_SHAPE = (2, 16, 4096, 128)
"""(batch, heads, sequence, head dim) of the causal bf16 attention timed forward and backward, through SDPA: the
kernel SDPA picks on this device is the one a model's attention runs."""


@dataclass(frozen=True, kw_only=True)
class DeviceTimings:
    """What :func:`measure_device_timings` measured on one CUDA device (seconds per call, CUDA events)."""

    device_name: str
    gemms: tuple[tuple[str, int, int, int, str, float], ...]
    """(shape name, m, n, k, dtype, seconds) of one (m x k) @ (k x n) GEMM: the fastest of the timed batches."""
    copy_bytes: int
    copy_s: float
    """One device-to-device copy of ``copy_bytes`` (it reads and writes that many)."""
    h2d_bytes: int
    h2d_s: float
    d2h_bytes: int
    d2h_s: float
    """Pinned host memory to the device and back."""
    launch_s: float
    """Per call of a :data:`LAUNCH_SHAPE` GEMM issued back to back."""
    attention: tuple[int, int, int, int, str, float] | None = None
    """(batch, heads, sequence, head dim, dtype, seconds) of one causal SDPA forward and backward; None: not timed."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def calibrated_clock_facts(facts: dict, timings: DeviceTimings) -> tuple[dict, float]:
    """The device row's clock facts (``meters.devices.clock_facts``: ``plan.clock.DeviceClock``'s keywords) with
    what ``timings`` measured on the device in place of the table's defaults, and the measured host link.

    Pure (no torch): the measurement is :func:`measure_device_timings`. Per dtype, the large GEMM's FLOP rate over
    the datasheet peak is that dtype's ``gemm_shares`` entry (bf16's is also ``gemm_share``, what a dtype not
    measured runs at); the copy's bytes read and written over its time, as a share of the datasheet HBM
    bandwidth, is ``hbm_share``; the tiny GEMM's time per call is ``kernel_s``; the slower direction of the
    pinned copies is the host link (bytes/s, one direction). Shares are capped at 1 (a boost clock above the
    datasheet's can measure a little over it). The causal attention's forward and backward, timed through SDPA,
    gives ``attention_share``: its FLOPs as the clock counts them (the causal half of QK^T and AV, the backward
    ``FLASH_BACKWARD`` times the forward) over its time and the peak. The skinny GEMMs are priced with the
    calibrated facts and their predicted/measured ratio goes into the source line: how well the roofline holds on
    this device. Every source line says what was measured here, replacing the table's lines for the same terms."""
    peak = facts["peak_flops"]
    largest: dict[str, tuple[float, float]] = {}  # dtype -> (flops, seconds) of its largest GEMM
    for _, m, n, k, dtype, s in timings.gemms:
        flops = 2.0 * m * n * k
        if dtype in peak and flops > largest.get(dtype, (0.0, 0.0))[0]:
            largest[dtype] = (flops, s)
    if not largest:
        raise ValueError("timings.gemms: need at least one GEMM in a dtype of the device's peak table")
    shares = {d: min(1.0, f / s / peak[d]) for d, (f, s) in largest.items()}
    hbm = 2.0 * timings.copy_bytes / timings.copy_s
    host = min(timings.h2d_bytes / timings.h2d_s, timings.d2h_bytes / timings.d2h_s)
    out = {**facts, "gemm_shares": shares, "gemm_share": shares.get("bf16", facts["gemm_share"]),
           "hbm_share": min(1.0, hbm / facts["hbm_bytes_per_s"]), "kernel_s": timings.launch_s}
    attention = ""
    if timings.attention is not None:
        b, h, seq, hd, dtype, att_s = timings.attention
        executed = 4.0 * b * seq * seq * h * hd * 0.5  # QK^T and AV, the causal half (as plan.clock prices it)
        out["attention_share"] = min(1.0, (1 + FLASH_BACKWARD) * executed / (att_s * peak[dtype]))
        attention = (f"; causal SDPA attention {b}x{h}x{seq}x{hd} {dtype} forward and backward "
                     f"{att_s * 1e3:.3g} ms = {out['attention_share']:.0%} of the peak")
    dev = DeviceClock(**out)
    skinny = []
    for name, m, n, k, dtype, s in timings.gemms:
        if name != "large" and dtype in peak:
            elem = 4 if dtype == Dtype.FP32 else 2
            skinny.append(f"{name} {m}x{n}x{k} {dtype} priced/measured "
                          f"{gemm_seconds(m, n, k, dtype=dtype, elem_bytes=elem, dev=dev) / s:.2f}")
    measured = (f"calibrated on this device ({timings.device_name}, plan --calibrate): large GEMM "
                + ", ".join(f"{d} {f / s / 1e12:.0f} TFLOP/s = {shares[d]:.0%} of {peak[d] / 1e12:.0f}"
                            for d, (f, s) in largest.items())
                + f"; HBM copy {hbm / 1e9:.0f} GB/s = {out['hbm_share']:.0%} of the datasheet's "
                  f"{facts['hbm_bytes_per_s'] / 1e9:.0f}; {timings.launch_s * 1e6:.1f} us per kernel "
                  f"({LAUNCH_SHAPE}^3 GEMMs back to back); host link {host / 1e9:.1f} GB/s per direction (pinned "
                  f"copies, the slower way)" + attention + (f"; {'; '.join(skinny)}" if skinny else ""))
    kept = tuple(line for line in facts.get("sources", ()) if not line.startswith("kernel shares"))
    unmeasured = ("" if timings.attention is not None else "attention, ") + "links and the eager share"
    out["sources"] = (measured, *kept, f"{unmeasured}: the table's (not measured here)")
    return out, host


def cuda_available() -> bool:
    """Whether this machine has a CUDA device to calibrate a GPU row on."""
    return torch.cuda.is_available()


def measure_device_timings(device: str = "cuda", *, reps: int = 10) -> DeviceTimings:
    """Time :data:`GEMM_SHAPES` in :data:`GEMM_DTYPES`, a :data:`COPY_BYTES` device copy, pinned
    :data:`HOST_BYTES` copies each way, back-to-back tiny GEMMs and a causal SDPA attention
    (:data:`ATTENTION_SHAPE`, forward and backward) on a CUDA ``device`` (CUDA events; the
    fastest of ``reps`` batches after a warm-up; fp32 GEMMs as torch runs them by default, TF32 off)."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev)

    def timed(fn, inner: int = 1) -> float:
        fn()
        torch.cuda.synchronize(dev)
        best = float("inf")
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                fn()
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3 / inner)
        return best

    gemms = []
    for d in map(str, GEMM_DTYPES):
        for shape, m, n, k in GEMM_SHAPES:
            x = torch.randn(m, k, device=dev, dtype=getattr(torch, TORCH_DTYPE_NAMES[d]))
            w = torch.randn(k, n, device=dev, dtype=getattr(torch, TORCH_DTYPE_NAMES[d]))
            gemms.append((shape, m, n, k, d, timed(lambda x=x, w=w: torch.mm(x, w), inner=3)))
            log.info("plan: calibrating %s: %s GEMM %dx%dx%d %s: %.3g ms", name, shape, m, n, k, d, gemms[-1][-1] * 1e3)
            del x, w
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src))
    del src, dst
    host = torch.empty(HOST_BYTES, dtype=torch.uint8, pin_memory=True)
    on_dev = torch.empty(HOST_BYTES, dtype=torch.uint8, device=dev)
    h2d_s = timed(lambda: on_dev.copy_(host, non_blocking=True))
    d2h_s = timed(lambda: host.copy_(on_dev, non_blocking=True))
    del host, on_dev
    x = torch.randn(LAUNCH_SHAPE, LAUNCH_SHAPE, device=dev, dtype=torch.bfloat16)
    launch_s = timed(lambda: torch.mm(x, x), inner=200)
    attention = _time_attention(dev, timed)
    log.info("plan: calibrating %s: causal SDPA attention %s bf16 forward and backward: %.3g ms", name,
             "x".join(map(str, ATTENTION_SHAPE)), attention[-1] * 1e3)
    torch.cuda.empty_cache()
    return DeviceTimings(device_name=name, gemms=tuple(gemms), copy_bytes=COPY_BYTES, copy_s=copy_s,
                         h2d_bytes=HOST_BYTES, h2d_s=h2d_s, d2h_bytes=HOST_BYTES, d2h_s=d2h_s, launch_s=launch_s,
                         attention=attention)


def _time_attention(dev: torch.device, timed: Callable[..., float]) -> tuple[int, int, int, int, str, float]:
    """One causal bf16 SDPA forward and backward of :data:`ATTENTION_SHAPE` (the kernel SDPA picks here)."""
    b, h, seq, hd = ATTENTION_SHAPE
    q, k, v = (torch.randn(b, h, seq, hd, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, seq, hd, device=dev, dtype=torch.bfloat16)

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    return b, h, seq, hd, str(Dtype.BF16), timed(step)


def calibrated_device_clock(row, *, timings: DeviceTimings | None = None, device: str = "cuda"):
    """``plan.clock.DeviceClock`` of a GPU ``row`` (``meters.devices.DeviceRow``) with this CUDA device's measured
    GEMM shares, HBM share, kernel cost and host link in place of the table's (:func:`calibrated_clock_facts`).
    Returns (clock, host bytes/s, the source lines to print). ``timings``: already measured (tests, the GPU
    check); default measured now on ``device``."""
    facts = clock_facts(row)
    if facts is None:
        raise ValueError(f"device row {row.name!r} has no clock facts (peak, HBM, kernel shares) to calibrate")
    timings = timings or measure_device_timings(device)
    out, host = calibrated_clock_facts(facts, timings)
    return DeviceClock(**out), host, list(out["sources"])
