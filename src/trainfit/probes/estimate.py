"""Estimated memory: the same step under fake tensors, nothing allocated.

The run is built and stepped exactly as :mod:`trainfit.probes.memory` does, but inside
``FakeTensorMode``: every op runs its shape/dtype rule only, and the tracker counts the
storages the real run would hold. ``.item()`` answers the healthy path (finite loss, no
overflow), so the optimizer always steps.

The block shortcut (why the 7B estimate takes seconds): a model made of L identical
blocks is traced with 3 and with 4 blocks only. The step is cut into segments -- per
phase, by the block running (forward: module hooks; backward: gradient hooks on block
outputs). Within a segment class {before the blocks, first block, second block,
second-to-last block, last block, optimizer} the live bytes at every moment are an exact
linear function of L (each block adds the same activations, parameters and gradients), and
within the middle blocks the peak sits at the second or the second-to-last block. So each
class's peak and parts are extrapolated linearly from L=3 and L=4 and the maximum is taken.
A test checks that this equals the full trace on a model small enough to trace fully.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from trainfit.config import LeversSection, RunConfig
from trainfit.errors import ConfigError
from trainfit.meters.attention import hf_attention_note, target_kernels
from trainfit.meters.experts import grouped_mm_fake_kernel
from trainfit.meters.fake_limits import meta_refusal, quiet_fake_failures
from trainfit.meters.flops import flop_counter
from trainfit.meters.tracker import MemoryTracker, ScalarStubs
from trainfit.probes.memory import (
    build_report,
    example_batch,
    masters_of,
    new_tracker,
    tracked_step,
    warm_up,
    with_batch,
)
from trainfit.plan.basis import BASIS_BATCHES
from trainfit.progress import logger, say
from trainfit.results import MemoryReport, fold_modules, precision_notes
from trainfit.run import build_run, task_of
from trainfit.vocabulary import PARTS, STRATEGIES, EveryKthBlock, MemoryBudget, StrategyName, strategy_facts

log = logger("memory")

SHORTCUT_DEPTHS = (3, 4)
"""Block counts traced by the shortcut (the smallest with distinct first/second/second-to-last/last)."""


@contextlib.contextmanager
def _fake_swappable(mode: FakeTensorMode) -> Iterator[None]:
    """Let ``module.to(dtype)`` work on fake parameters.

    ``nn.Module._apply`` swaps fake parameters with ``torch.utils.swap_tensors``, which refuses
    tensors that have weak references -- and the fake-tensor converter's memo holds one for
    each. Dropping those memo entries (a cache of real->fake conversions we do not need
    for these tensors) lets the swap go through. Scoped to this context.
    """
    memo = mode.fake_tensor_converter.meta_converter
    original = torch.utils.swap_tensors

    def swap(t1, t2):
        for d in (memo.tensor_memo, memo.storage_memo):
            for k in [k for k, v in list(d.items()) if v is t1 or v is t2]:
                del d[k]
        return original(t1, t2)

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


class SegmentStats:
    """Per (phase, segment) peak and part maxima, fed by the tracker after every op."""

    def __init__(self, model: nn.Module, block_names: list[str], *, unit: int = 1) -> None:
        self.n = len(block_names)
        self.unit = unit
        """Blocks per repeated unit: 1, or K under every:K checkpointing (K blocks repeat as one)."""
        self.tag: tuple[int, int] = (0, 0)
        """(step, micro-batch) being traced: segments of different windows are kept apart."""
        self.fwd = -1  # index of the last block entered in forward (-1: before the blocks)
        self.bwd = -1  # index of the block whose backward runs (-1: head and loss)
        self.peak: dict[tuple[str, int], dict[str, int]] = {}
        self.part_max: dict[tuple[str, int], dict[str, int]] = {}
        self._handles = []
        modules = dict(model.named_modules())
        for i, name in enumerate(block_names):
            m = modules[name]
            self._handles.append(m.register_forward_pre_hook(self._enter(i)))
            self._handles.append(m.register_forward_hook(self._leave(i)))
        self._last_phase = ""

    def _enter(self, i: int):
        def hook(module, args):
            if torch._C._current_graph_task_id() == -1:  # not a checkpoint recompute
                self.fwd = i
        return hook

    def _leave(self, i: int):
        def on_grad(g):
            self.bwd = i

        def hook(module, args, out):
            if torch._C._current_graph_task_id() != -1:
                return
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(on_grad)  # fires when this block's backward starts
                    break
        return hook

    def __call__(self, tr: MemoryTracker) -> None:
        phase = tr._current_phase()
        if phase != self._last_phase:
            if phase == "forward":
                self.fwd = -1
            if phase == "backward" and self._last_phase == "forward":
                self.bwd = -1
            self._last_phase = phase
        if phase == "setup":
            return
        seg = self.fwd if phase == "forward" else self.bwd if phase == "backward" else -1
        key = (self.tag, phase, seg)
        pk = self.peak.get(key)
        if pk is None or tr.live_bytes > pk["peak"]:
            self.peak[key] = {"peak": tr.live_bytes, **tr.totals}
        pm = self.part_max.setdefault(key, dict.fromkeys(PARTS, 0))
        for p in PARTS:
            if tr.totals[p] > pm[p]:
                pm[p] = tr.totals[p]

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def by_class(self) -> dict[tuple, tuple[dict[str, int], dict[str, int]]]:
        """Segments merged into classes whose values are linear in the block count, per (tag, phase)."""
        out: dict[tuple, tuple[dict[str, int], dict[str, int]]] = {}
        for (tag, phase, seg), pk in self.peak.items():
            for cls in _classes(seg, self.n, unit=self.unit):
                k = (tag, phase, cls)
                old_pk, old_pm = out.get(k, ({"peak": -1}, dict.fromkeys(PARTS, 0)))
                pm = {p: max(old_pm[p], self.part_max[(tag, phase, seg)][p]) for p in PARTS}
                out[k] = (pk if pk["peak"] > old_pk["peak"] else old_pk, pm)
        return out


def _classes(i: int, n: int, *, unit: int = 1) -> tuple[str, ...]:
    """Class names of block ``i`` of ``n``: first, second, second-to-last, last or middle -- of the repeated
    *units* of ``unit`` blocks (every:K checkpointing repeats K blocks), with the block's place in its unit;
    the blocks after the last whole unit are a tail of their own."""
    if i < 0:
        return ("outside",)
    if unit > 1:
        units, rem = divmod(n, unit)
        if i >= units * unit:
            return (f"tail{i - units * unit}",)
        return tuple(f"{c}.{i % unit}" for c in _classes(i // unit, units))
    names = []
    if i == 0:
        names.append("first")
    if i == n - 1:
        names.append("last")
    if i == 1:
        names.append("second")
    if i == n - 2:
        names.append("second-to-last")
    return tuple(names) or ("middle",)


@contextlib.contextmanager
def _trace_limits(model: str) -> Iterator[None]:
    """Around a fake-tensor trace: a failure whose op the real CPU kernel runs (a meta kernel stricter than the
    real one, ``meters.fake_limits``) is refused as the trace's limit, naming the op, never as the user's config;
    torch's own log of the failing meta kernel stays off stderr."""
    try:
        with quiet_fake_failures():
            yield
    except Exception as e:
        op = meta_refusal(e)
        if not op:
            raise
        raise ConfigError("method", "estimate", f"measure for {model}",
                          f"torch's fake-tensor kernel refuses what its CPU kernel runs, {op}; measure a real step "
                          "instead: trainfit memory --measure, or trainfit plan --basis measure") from None


def _fake_batch(mode: FakeTensorMode, batch: Any) -> Any:
    return tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)


def trace(cfg: RunConfig, batch: Any = None, *, segments: bool = False):
    """Build and step the run under fake tensors. Returns (run, tracker, stats, batch_size)."""
    if batch is None:
        task = task_of(cfg)
        batch = example_batch(task, cfg.micro_batch)  # small real tensors (token ids / images)
    n = next((t.shape[0] for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim()), 1)
    with _trace_limits(cfg.model), grouped_mm_fake_kernel(), FakeTensorMode(allow_non_fake_inputs=True) as mode, \
            _fake_swappable(mode), contextlib.ExitStack() as branches:
        with ScalarStubs():  # .item() answered; nothing counted
            run = build_run(cfg)  # some inits read values (e.g. trunc_normal_ bounds)
            fake_trace = getattr(run.task, "fake_trace", None)
            if fake_trace is not None:  # take the branches a real step takes (see Task.fake_trace)
                branches.enter_context(fake_trace())
            mbs = [_fake_batch(mode, batch)] * cfg.accumulation
            warm_up(run, mbs)
        tracker = new_tracker(run, stub_scalars=True)
        stats = None
        if segments:
            stats = SegmentStats(run.model, run.task.block_names(run.model))
            tracker.listeners.append(stats)
        try:
            tracked_step(run, mbs, tracker)
        finally:
            if stats:
                stats.close()
    return run, tracker, stats, n


def _with_depth(cfg: RunConfig, key: str, depth: int) -> RunConfig:
    """``cfg`` at ``depth`` blocks: ``key`` (``Task.depth_key``; comma-separated keys all take the depth,
    e.g. an encoder-decoder's two stacks) appended to the model config, where later keys win."""
    sep = "," if cfg.model_config.strip() else ""  # a JSON path may come first (hf:)
    return dataclasses.replace(cfg, model_config=cfg.model_config + sep + ",".join(f"{k}={depth}" for k in key.split(",")))


def shortcut_applies(cfg: RunConfig, task) -> str:
    """'' when the block shortcut is exact for this run, else the reason it is not used."""
    if not getattr(task, "depth_key", ""):
        return "the task does not say how to change its number of blocks"
    if task.depth <= max(SHORTCUT_DEPTHS):
        return f"only {task.depth} blocks: traced in full"
    if isinstance(cfg.checkpointing, EveryKthBlock) and cfg.checkpointing.k > 1:
        return "every:K checkpointing makes blocks differ: traced in full"
    return _whole_only(cfg.section("levers"))


def _whole_only(levers: LeversSection) -> str:
    """Why the block shortcut cannot apply at any depth ('' when it can)."""
    if isinstance(levers.checkpointing, MemoryBudget):  # which blocks it checkpoints depends on the depth
        return (f"{levers.checkpointing.spec} checkpoints a share of the blocks that depends on their number: "
                "traced in full")
    if levers.offload:
        return "offload: the device/host split is traced in full"
    return ""


def _lin(v_a: float, v_b: float, depth: int, depths: tuple[int, int] = SHORTCUT_DEPTHS) -> int:
    a, b = depths
    return int(round(v_a + (depth - a) * (v_b - v_a) / (b - a)))


def _extrapolated_classes(st_a: SegmentStats, st_b: SegmentStats, depth: int,
                          depths: tuple[int, int] = SHORTCUT_DEPTHS) -> dict | None:
    """{(tag, phase, class): (peak dict, part maxima)} at ``depth`` blocks, linear from the two traces;
    None when the two traces' segment classes differ (the blocks are not identical)."""
    cls_a, cls_b = st_a.by_class(), st_b.by_class()
    if set(cls_a) != set(cls_b):
        return None
    out = {}
    for k in cls_a:
        (pk_a, pm_a), (pk_b, pm_b) = cls_a[k], cls_b[k]
        out[k] = ({p: _lin(pk_a[p], pk_b[p], depth, depths) for p in ("peak", *PARTS)},
                  {p: _lin(pm_a[p], pm_b[p], depth, depths) for p in PARTS})
    return out


def _phase_peaks(classes: dict, tag: tuple[int, int] | None = None) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """(peak per phase, part maxima) over the classes of one window ``tag`` (None: every window)."""
    phases: dict[str, dict[str, int]] = {}
    part_max = dict.fromkeys(PARTS, 0)
    for (t, phase, _), (pk, pm) in classes.items():
        if tag is not None and t != tag:
            continue
        if phase not in phases or pk["peak"] > phases[phase]["peak"]:
            phases[phase] = pk
        for p in PARTS:
            part_max[p] = max(part_max[p], pm[p])
    return phases, part_max


def _extrapolate(cfg: RunConfig, task, batch: Any) -> MemoryReport | None:
    a, b = SHORTCUT_DEPTHS
    L = task.depth
    (run_a, tr_a, st_a, n), (run_b, tr_b, st_b, _) = (
        trace(_with_depth(cfg, task.depth_key, d), batch, segments=True) for d in (a, b))
    extrapolated = _extrapolated_classes(st_a, st_b, L)
    if extrapolated is None:  # the blocks are not identical after all: trace in full
        return None
    phases, part_max = _phase_peaks(extrapolated)
    peak_phase = max(phases, key=lambda ph: phases[ph]["peak"])
    peak = phases[peak_phase]
    mods_a = dict(fold_modules(tr_a.module_activation_bytes, run_a.task.block_names(run_a.model), top=10**6))
    mods_b = dict(fold_modules(tr_b.module_activation_bytes, run_b.task.block_names(run_b.model), top=10**6))
    mods = {m: _lin(mods_a.get(m, 0), mods_b.get(m, 0), L) for m in set(mods_a) | set(mods_b)}
    n_a, n_b = (sum(p.numel() for p in r.model.parameters()) for r in (run_a, run_b))
    m_a, m_b = (sum(t.untyped_storage().nbytes() for t in masters_of(r)) for r in (run_a, run_b))
    n_params, master = _lin(n_a, n_b, L), _lin(m_a, m_b, L)
    return MemoryReport(
        method="estimated", model=cfg.model, precision=cfg.precision, checkpointing=cfg.checkpointing.spec,
        optimizer=cfg.optimizer, batch=n, seq_len=cfg.seq_len, accumulation=cfg.accumulation, n_params=n_params,
        params_bytes=part_max["params"], grads_bytes=part_max["grads"], optimizer_bytes=part_max["optimizer"],
        master_weights_bytes=master, activations_bytes=part_max["activations"],
        temporaries_bytes=peak["temporaries"], peak_bytes=peak["peak"], peak_phase=peak_phase,
        peak_parts={p: peak[p] for p in PARTS}, phases=phases,
        top_modules=tuple(sorted(mods.items(), key=lambda kv: (-kv[1], kv[0]))[:10]),
        notes=precision_notes(cfg.precision, n_params, part_max["params"], master),
        details={"shortcut": f"traced {a} and {b} of {L} blocks, extrapolated linearly per segment"})


def estimate_memory(cfg: RunConfig, *, batch: Any = None, world_size: int = 1,
                    strategy: str = StrategyName.SINGLE,
                    shortcut: bool = True, target: str = "cpu") -> MemoryReport:
    """Estimate one optimizer step's memory without allocating (fake tensors).

    Args:
        cfg: the run configuration.
        batch: None, an int (micro-batch size), or a ready (real, small) micro-batch.
        world_size: ranks the run is spread over (per-rank bytes are reported).
        strategy: a strategy name -- the parts its vocabulary row shards are divided by
            ``world_size`` analytically (gathered-parameter and bucket buffers are not counted).
        shortcut: trace 3 and 4 identical blocks and extrapolate (see module doc); False
            traces the whole model.
        target: the device whose kernels the trace follows (``meters.attention.target_kernels``: attention,
            dropout, CUDA autocast's fp32 ops, the foreach optimizer); "cpu": this machine's. What differs
            from the CPU trace is listed in the report's notes.
    Returns:
        A :class:`MemoryReport` with method="estimated".
    """
    if strategy not in STRATEGIES:
        raise ConfigError("strategy", strategy, tuple(STRATEGIES))
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("world_size", world_size, "an integer >= 1")
    t0 = time.perf_counter()
    cfg, given = with_batch(cfg, batch)
    cfg = dataclasses.replace(cfg, strategy=StrategyName.SINGLE, devices=1)  # traced on one device, sharded below
    task = task_of(cfg)
    if given is None:
        given = example_batch(task, cfg.micro_batch)
    why_not = shortcut_applies(cfg, task) if shortcut else "shortcut off"
    say(log, "memory: tracing one step of %s on fake tensors (%s, checkpointing %s, micro-batch %s x accumulation "
        "%d; %s) ...", cfg.model, cfg.precision, cfg.checkpointing.spec, cfg.micro_batch, cfg.accumulation,
        "3 and 4 blocks, extrapolated" if not why_not else why_not)
    with target_kernels(target) as kernels:
        report = None if why_not else _extrapolate(cfg, task, given)
        if report is None:
            why_not = why_not or "segments differ between the 3- and 4-block traces: traced in full"
            run, tracker, _, n = trace(cfg, given)
            report = build_report(run, tracker, method="estimated", batch=n, masters=masters_of(run), wall_s=0.0,
                                  details={"shortcut": why_not})
    if target != "cpu":
        with torch.device("meta"):
            note = hf_attention_note(task.build_model(), target)
        report = dataclasses.replace(report, notes=(*report.notes, f"kernels of {target}: {note}",
                                                    *(f"kernels of {target}: {x}" for x in kernels.lines())))
    report = shard_parts(report, strategy, world_size)
    return dataclasses.replace(report, wall_s=time.perf_counter() - t0, strategy=str(strategy), world_size=world_size)


def shard_parts(report: MemoryReport, strategy: str, world_size: int) -> MemoryReport:
    """Divide the parts a ZeRO stage shards by the world size (pure, analytic)."""
    parts = strategy_facts(strategy).shards  # ZeRO paper, Rajbhandari et al. 2020, fig. 1
    if world_size == 1 or not parts:
        return report

    def cut(d: dict[str, int]) -> dict[str, int]:
        out = dict(d)
        for p in parts:
            saved = d[p] - d[p] // world_size
            out[p] = d[p] // world_size
            if "peak" in out:
                out["peak"] -= saved
        return out

    peak_parts = cut({**report.peak_parts, "peak": report.peak_bytes})
    phases = {k: cut(dict(v)) for k, v in report.phases.items()}
    fields = {f"{p}_bytes": getattr(report, f"{p}_bytes") // world_size for p in parts}
    if "optimizer" in parts:
        fields["master_weights_bytes"] = report.master_weights_bytes // world_size
    return dataclasses.replace(
        report, **fields, peak_bytes=peak_parts.pop("peak"), peak_parts=peak_parts, phases=phases,
        details={**report.details, "sharding": f"{strategy} over {world_size} ranks: {', '.join(parts)} divided "
                 "analytically (per-rank; gathered-parameter and bucket buffers not counted)"})


# -- windows for the planner's basis ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def model_units(cfg: RunConfig) -> tuple[int, int, float]:
    """(blocks, trainable parameter tensors, parameters of the largest FSDP unit: a block or the root,
    as ``strategies/zero.py`` wraps them), from the full model built on the meta device (nothing allocated)."""
    task = task_of(cfg)
    with torch.device("meta"):
        meta = task.build_model()
        blocks = task.block_names(meta)
        n_tensors = sum(1 for p in meta.parameters() if p.requires_grad)
        per_block = [sum(p.numel() for p in meta.get_submodule(name).parameters()) for name in blocks]
        total = sum(p.numel() for p in meta.parameters())
    return max(len(blocks), 1), n_tensors, float(max([*per_block, total - sum(per_block)]))


@dataclass(frozen=True, kw_only=True)
class WindowReport:
    """One (micro-batch, accumulation) window of a traced step: what ``plan.basis.basis_from_reports`` reads."""

    method: str
    precision: str
    checkpointing: str
    batch: int
    n_params: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    phases: dict[str, dict[str, int]]


def shortcut_depths(cfg: RunConfig, task) -> tuple[tuple[int, int] | None, int, str]:
    """(the two depths to trace, blocks per repeated unit, why not) for the block shortcut of ``cfg``.

    Under every:K the unit is K blocks (checkpointed, then K-1 kept) and the depths are 3 and 4 units plus
    the remainder L mod K, which both traces keep as their tail."""
    k = cfg.checkpointing.k if isinstance(cfg.checkpointing, EveryKthBlock) else 1
    if not getattr(task, "depth_key", ""):
        return None, k, "the task does not say how to change its number of blocks"
    whole = _whole_only(cfg.section("levers"))
    if whole:
        return None, k, whole
    rem = task.depth % k
    a, b = (d * k + rem for d in SHORTCUT_DEPTHS)
    if task.depth <= b:
        return None, k, f"only {task.depth} blocks: traced in full"
    return (a, b), k, ""


class _RecomputeCount:
    """The FLOPs full checkpointing would recompute, counted in a forward that checkpoints nothing.

    torch's non-reentrant checkpoint (the one ``levers/checkpointing.py`` applies to each block) reruns a block's
    forward in backward only until the last tensor the block saved is produced again, then stops: a block that
    ends in a matmul whose output nothing saves (no dropout after it) skips it. So the count is, per block, the
    FLOPs from its start to its last saved tensor (``FlopCounterMode`` counts an op as it returns, before
    autograd saves its inputs). The planner bounds a fully checkpointed row's step with it before tracing
    that pair (``front/plan.py``); ``tests/plan/test_fast_basis.py`` holds it equal to the recompute counted
    in the checkpointed trace."""

    def __init__(self, run) -> None:
        self.flops = 0
        self._on = run.cfg.checkpointing.spec == "none" and not run.offload  # offload's own pack hooks stay
        self._blocks = [run.model.get_submodule(n) for n in run.task.block_names(run.model)]
        self._start: int | None = None
        self._last: int | None = None

    def loss_fn(self, loss, counter):
        if not self._on:
            return None

        def enter(module, args):
            self._start = self._last = counter.get_total_flops()

        def leave(module, args, out):
            self.flops += self._last - self._start
            self._start = None

        def pack(t):
            if self._start is not None:
                self._last = counter.get_total_flops()
            return t

        def counted(model, mb):
            handles = [h for m in self._blocks for h in (m.register_forward_pre_hook(enter),
                                                         m.register_forward_hook(leave))]
            self.flops = 0
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    return loss(model, mb)
            finally:
                for h in handles:
                    h.remove()
        return counted


def _trace_windows(cfg: RunConfig, batches: tuple[int, int], unit: int, target: str = "cpu") -> SegmentStats:
    """Warm up on one micro-batch, then trace two steps of accumulation 2: [b1, b2] and [b2, b1].

    Each window's segments are kept apart (``SegmentStats.tag`` = (step, micro-batch)), so one trace gives
    the first micro-batch of a step at both sizes (no gradients live yet) and a later micro-batch at both
    sizes (every gradient live): the four reports a basis is fitted from."""
    task = task_of(cfg)
    real = [example_batch(task, b) for b in batches]
    with _trace_limits(cfg.model), target_kernels(target) as kernels, grouped_mm_fake_kernel(), \
            FakeTensorMode(allow_non_fake_inputs=True) as mode, _fake_swappable(mode), \
            contextlib.ExitStack() as branches:
        with ScalarStubs():  # .item() answered; nothing counted
            run = build_run(cfg)
            fake_trace = getattr(run.task, "fake_trace", None)
            if fake_trace is not None:
                branches.enter_context(fake_trace())
            f1, f2 = (_fake_batch(mode, b) for b in real)
            recompute = _RecomputeCount(run)
            with flop_counter() as flops:  # the warm-up step as it runs: recompute included
                warm_up(run, [f1], loss_fn=recompute.loss_fn(run.task.loss, flops))
        tracker = new_tracker(run, stub_scalars=True)
        stats = SegmentStats(run.model, run.task.block_names(run.model), unit=unit)
        tracker.listeners.append(stats)
        try:
            for step, mbs in enumerate(([f1, f2], [f2, f1])):
                tracked_step(run, mbs, tracker, on_micro_batch=lambda j, step=step: setattr(stats, "tag", (step, j)))
        finally:
            stats.close()
    stats.n_params = sum(p.numel() for p in {id(p): p for p in run.model.parameters()}.values())
    stats.hardware_flops_per_sample = flops.get_total_flops() / batches[0]
    stats.full_recompute_flops_per_sample = recompute.flops / batches[0]
    stats.kernel_lines = [*kernels.lines(), hf_attention_note(run.model, target)]
    return stats


class Windows(NamedTuple):
    """What :func:`window_reports` returns."""

    reports: tuple[WindowReport, WindowReport, WindowReport, WindowReport]
    """(r1, r2, q1, q2): one micro-batch at each basis batch, then accumulation 2 at each."""
    how: str
    hardware_flops_per_sample: float
    full_recompute_flops_per_sample: float
    """What full checkpointing would recompute, per sample (:class:`_RecomputeCount`), counted in a trace
    without checkpointing; 0.0 in a checkpointed trace (its hardware FLOPs hold its own recompute)."""
    kernel_lines: list[str]
    """What the target's kernels changed against this CPU's."""


def window_reports(cfg: RunConfig, batches: tuple[int, int] = BASIS_BATCHES, *, target: str = "cpu") -> Windows:
    """One micro-batch at ``batches[0]`` and ``batches[1]``, and accumulation 2 at
    each, estimated from one warm-up and two traced steps -- per depth of the block shortcut (two traces),
    or one full-depth trace where the shortcut does not apply. The same numbers as four separate
    :func:`estimate_memory` calls (at 2 x 4 traces); ``tests/plan/test_fast_basis.py`` holds them equal.
    ``target``: a ``meters.devices.DEVICES`` name whose kernels the trace follows (``meters.attention``:
    attention, dropout, CUDA autocast's fp32 ops, the foreach optimizer); "cpu" traces this machine's.
    The FLOPs are counted by ``FlopCounterMode`` over the warm-up step (checkpointing's recompute included)."""
    cfg = dataclasses.replace(cfg, strategy=StrategyName.SINGLE, devices=1, accumulation=2, micro_batch=batches[0])
    task = task_of(cfg)
    depths, unit, why_not = shortcut_depths(cfg, task)
    log.debug("plan: tracing the windows of %s (%s, checkpointing %s; %s) ...", cfg.model, cfg.precision,
              cfg.checkpointing.spec, f"{depths[0]} and {depths[1]} of {task.depth} blocks" if depths else why_not)
    classes = None
    if depths is not None:
        st_a, st_b = (_trace_windows(_with_depth(cfg, task.depth_key, d), batches, unit, target) for d in depths)
        classes = _extrapolated_classes(st_a, st_b, task.depth, depths)
        n_params = _lin(st_a.n_params, st_b.n_params, task.depth, depths)
        hw_flops = _lin(st_a.hardware_flops_per_sample, st_b.hardware_flops_per_sample, task.depth, depths)
        recompute = _lin(st_a.full_recompute_flops_per_sample, st_b.full_recompute_flops_per_sample, task.depth,
                         depths)
        how = f"traced {depths[0]} and {depths[1]} of {task.depth} blocks, extrapolated linearly per segment"
        kernel_lines = st_b.kernel_lines
        if classes is None:
            why_not = "segments differ between the two shortcut depths: traced in full"
    if classes is None:
        st = _trace_windows(cfg, batches, 1, target)
        classes = {k: v for k, v in st.by_class().items()}
        n_params, how, hw_flops = st.n_params, why_not, st.hardware_flops_per_sample
        recompute = st.full_recompute_flops_per_sample
        kernel_lines = st.kernel_lines
    win = {tag: _phase_peaks(classes, tag) for tag in {k[0] for k in classes}}
    part_max = _phase_peaks(classes)[1]
    optimizer = win[(1, 1)][0].get("optimizer", {"peak": 0, **dict.fromkeys(PARTS, 0)})

    def fwd_bwd(*tags):
        out = {}
        for ph in ("forward", "backward"):
            cands = [win[t][0][ph] for t in tags if ph in win[t][0]]
            if cands:
                out[ph] = max(cands, key=lambda d: d["peak"])
        return out

    def report(batch: int, accumulation: int, tags) -> WindowReport:
        return WindowReport(method="estimated", precision=str(cfg.precision), checkpointing=cfg.checkpointing.spec,
                            batch=batch, n_params=n_params, params_bytes=part_max["params"],
                            grads_bytes=part_max["grads"], optimizer_bytes=part_max["optimizer"],
                            phases={**fwd_bwd(*tags), "optimizer": optimizer})

    b1, b2 = batches
    return Windows(reports=(report(b1, 1, [(0, 0)]), report(b2, 1, [(1, 0)]),
                            report(b1, 2, [(0, 0), (1, 1)]), report(b2, 2, [(1, 0), (0, 1)])),
                   how=how, hardware_flops_per_sample=float(hw_flops), full_recompute_flops_per_sample=float(recompute),
                   kernel_lines=kernel_lines)
