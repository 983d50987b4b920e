"""What the pure planner is given, measured: bases from the memory probes, links from the device
table, compute rates and distributed overheads calibrated on this machine.

The planner's torch side: ``plan/`` never builds a model, steps a run or starts a process; this
probe does, and hands ``plan.search`` plain values (a :class:`~trainfit.plan.cost.Basis` per
(precision, checkpointing) pair, :class:`~trainfit.plan.cost.Links` per precision).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from trainfit.config import RunConfig, make_config
from trainfit.plan.cost import Basis, Links, fit_dist_overhead
from trainfit.probes.compile import measure_compile_speedup
from trainfit.probes.estimate import BASIS_BATCHES
from trainfit.probes.fastbasis import BASIS_SOURCES, basis_provider, links_provider  # noqa: F401 -- re-exported
from trainfit.probes.fullbasis import report_basis  # noqa: F401 -- re-exported (its home since issue 29)
from trainfit.probes.memory import example_batch
from trainfit.run import build_run
from trainfit.strategies.launch import spawn_errors, spawn_local
from trainfit.tasks.base import to_device
from trainfit.vocabulary import STRATEGIES, PrecisionName, StrategyName


def measure_step_s(cfg: RunConfig, *, reps: int = 5, clock: Callable[[], float] | None = None,
                   statistic: str = "min") -> float:
    """Fastest of ``reps`` optimizer steps of ``cfg`` on worst-case (full-length) micro-batches, after
    one step that allocates the optimizer state. The minimum, not the median: on a shared machine the
    other processes only ever add time, and the fastest step is the one they disturbed least.
    ``clock`` defaults to wall time; ``time.thread_time`` with one torch thread measures the step's
    own CPU time, which other processes on a loaded machine barely change. ``statistic="median"``
    for steps of several processes: there every step waits for the slowest rank at each
    collective, and the step-to-step spread is intrinsic (2 gloo ranks on 2 cores: 14-35 ms for
    one zero1 step), so the median is the throughput a run sees and the minimum a lucky draw."""
    clock = clock or time.perf_counter
    run = build_run(cfg)
    mbs = [to_device(example_batch(run.task, cfg.micro_batch), run.strategy.device)] * cfg.accumulation
    times = []
    for i in range(reps + 1):
        t0 = clock()
        run.step(mbs)
        if i:
            times.append(clock() - t0)
    if statistic not in ("min", "median"):
        raise ValueError(f"statistic={statistic!r}: choose min or median")
    return min(times) if statistic == "min" else sorted(times)[len(times) // 2]


def calibrated_links(base_cfg: RunConfig, plain: Callable[..., Links], basis: Callable[[str, str], Basis], *,
                     reps: int = 5, clock: Callable[[], float] | None = None) -> Callable[[str, str], Links]:
    """Links whose compute rate and fixed costs are fitted to this model's measured steps.

    A small model runs far below the matmul peak (per-op overhead dominates), so on a CPU the
    FLOP rate alone mispredicts. Three measured steps per (precision, checkpointing) fit
    ``step_s = accumulation x (per_micro_batch_s + per_sample_s x micro_batch) + per_step_s``:
    t(2,1), t(4,1) and t(2,2) give per_sample_s, per_micro_batch_s and per_step_s.
    """
    cache: dict[tuple[str, str], Links] = {}

    def links(p: str, ck: str = "none") -> Links:
        if (p, ck) not in cache:
            def t(m: int, k: int) -> float:
                return measure_step_s(make_config({"precision": p, "checkpointing": ck, "micro_batch": m,
                                                   "accumulation": k, "strategy": StrategyName.SINGLE},
                                                  base=base_cfg),
                                      reps=reps, clock=clock)

            t21, t41, t22 = t(2, 1), t(4, 1), t(2, 2)
            per_sample = max((t41 - t21) / 2, 1e-9)
            per_mb = max(t22 - t41, 0.0)
            per_step = max(t21 - per_mb - 2 * per_sample, 0.0)
            cache[(p, ck)] = dataclasses.replace(
                plain(p, ck), flops_per_s=basis(p, ck).hardware_flops_per_sample / per_sample,
                overhead_per_micro_batch_s=per_mb, per_step_s=per_step)
        return cache[(p, ck)]

    return links


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
