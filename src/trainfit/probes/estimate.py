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
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from trainfit.config import RunConfig
from trainfit.errors import ConfigError
from trainfit.meters.tracker import MemoryTracker
from trainfit.probes.memory import (
    build_report,
    example_batch,
    masters_of,
    new_tracker,
    tracked_step,
    warm_up,
    with_batch,
)
from trainfit.results import MemoryReport, fold_modules, precision_notes
from trainfit.run import build_run, task_of
from trainfit.vocabulary import PARTS, STRATEGIES, EveryKthBlock, StrategyName, strategy_facts

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

    def __init__(self, model: nn.Module, block_names: list[str]) -> None:
        self.n = len(block_names)
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
        key = (phase, seg)
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

    def by_class(self) -> dict[tuple[str, str], tuple[dict[str, int], dict[str, int]]]:
        """Segments merged into classes whose values are linear in the block count."""
        out: dict[tuple[str, str], tuple[dict[str, int], dict[str, int]]] = {}
        for (phase, seg), pk in self.peak.items():
            for cls in _classes(seg, self.n):
                k = (phase, cls)
                old_pk, old_pm = out.get(k, ({"peak": -1}, dict.fromkeys(PARTS, 0)))
                pm = {p: max(old_pm[p], self.part_max[(phase, seg)][p]) for p in PARTS}
                out[k] = (pk if pk["peak"] > old_pk["peak"] else old_pk, pm)
        return out


def _classes(i: int, n: int) -> tuple[str, ...]:
    if i < 0:
        return ("outside",)
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


def _fake_batch(mode: FakeTensorMode, batch: Any) -> Any:
    return tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)


def trace(cfg: RunConfig, batch: Any = None, *, segments: bool = False):
    """Build and step the run under fake tensors. Returns (run, tracker, stats, batch_size)."""
    if batch is None:
        task = task_of(cfg)
        batch = example_batch(task, cfg.micro_batch)  # small real tensors (token ids / images)
    n = next((t.shape[0] for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim()), 1)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, _fake_swappable(mode), contextlib.ExitStack() as branches:
        with MemoryTracker(stub_scalars=True, classify=False, exact=False):  # only to answer .item()
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
    sep = "," if cfg.model_config.strip() else ""  # later keys win; a JSON path may come first (hf:)
    return dataclasses.replace(cfg, model_config=f"{cfg.model_config}{sep}{key}={depth}")


def shortcut_applies(cfg: RunConfig, task) -> str:
    """'' when the block shortcut is exact for this run, else the reason it is not used."""
    if not getattr(task, "depth_key", ""):
        return "the task does not say how to change its number of blocks"
    if task.depth <= max(SHORTCUT_DEPTHS):
        return f"only {task.depth} blocks: traced in full"
    if isinstance(cfg.checkpointing, EveryKthBlock) and cfg.checkpointing.k > 1:
        return "every:K checkpointing makes blocks differ: traced in full"
    return ""


def _lin(v_a: float, v_b: float, depth: int) -> int:
    a, b = SHORTCUT_DEPTHS
    return int(round(v_a + (depth - a) * (v_b - v_a) / (b - a)))


def _extrapolate(cfg: RunConfig, task, batch: Any) -> MemoryReport | None:
    a, b = SHORTCUT_DEPTHS
    L = task.depth
    (run_a, tr_a, st_a, n), (run_b, tr_b, st_b, _) = (
        trace(_with_depth(cfg, task.depth_key, d), batch, segments=True) for d in (a, b))
    cls_a, cls_b = st_a.by_class(), st_b.by_class()
    if set(cls_a) != set(cls_b):  # the blocks are not identical after all: trace in full
        return None
    phases: dict[str, dict[str, int]] = {}
    part_max = dict.fromkeys(PARTS, 0)
    for k in cls_a:
        (pk_a, pm_a), (pk_b, pm_b) = cls_a[k], cls_b[k]
        pk = {p: _lin(pk_a[p], pk_b[p], L) for p in ("peak", *PARTS)}
        if k[0] not in phases or pk["peak"] > phases[k[0]]["peak"]:
            phases[k[0]] = pk
        for p in PARTS:
            part_max[p] = max(part_max[p], _lin(pm_a[p], pm_b[p], L))
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
                    shortcut: bool = True) -> MemoryReport:
    """Estimate one optimizer step's memory without allocating (fake tensors).

    Args:
        cfg: the run configuration.
        batch: None, an int (micro-batch size), or a ready (real, small) micro-batch.
        world_size: ranks the run is spread over (per-rank bytes are reported).
        strategy: a strategy name -- the parts its vocabulary row shards are divided by
            ``world_size`` analytically (gathered-parameter and bucket buffers are not counted).
        shortcut: trace 3 and 4 identical blocks and extrapolate (see module doc); False
            traces the whole model.
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
    report = None if why_not else _extrapolate(cfg, task, given)
    if report is None:
        why_not = why_not or "segments differ between the 3- and 4-block traces: traced in full"
        run, tracker, _, n = trace(cfg, given)
        report = build_report(run, tracker, method="estimated", batch=n, masters=masters_of(run), wall_s=0.0,
                              details={"shortcut": why_not})
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
