"""An out-of-memory that explains itself: what was full, which lever frees how much, and the flags that fit.

When a training step runs out of memory (on CPU the tracker's ``memory_cap``, on CUDA
``torch.OutOfMemoryError``) with auto-fit off, ``trainfit train`` calls :func:`explain_oom`:

1. **Snapshot.** The failing step is replayed once on a fresh run under a classifying
   :class:`~trainfit.meters.tracker.MemoryTracker` (same cap), which raises at the same op; the five parts
   live at that moment, the phase, the top modules by activation bytes and the device/host split are
   written to ``RUN_DIR/oom.json`` (atomically).
2. **Levers, priced by the estimator** (``probes.estimate.estimate_memory``, fake tensors: nothing
   allocated) for this model and shape: halving the micro-batch while doubling the accumulation (global
   batch kept), checkpointing selective / full, bf16-mixed / bf16-true, and zero2 / zero3 when there are
   several devices. Each candidate's estimated peak is compared with the cap (less a
   :data:`MARGIN` for the estimate's error).
3. **One paragraph**: what was full, what each lever frees, and the exact flags of the smallest change
   that fits -- "smallest" in :data:`LEVER_ORDER`: the cheapest in step time first.

Pure core: :func:`rank_changes` and :func:`paragraph`; the rest drives runs.
"""

from __future__ import annotations

import dataclasses
import gc
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from trainfit.checkpoint import atomic_write_bytes
from trainfit.config import LeversSection, RunConfig, RunSection
from trainfit.errors import TrainfitError
from trainfit.outputs import mark_non_finite
from trainfit.progress import inner
from trainfit.probes.estimate import estimate_memory
from trainfit.probes.memory import example_batch, new_tracker, tracked_step
from trainfit.results import fold_modules
from trainfit.run import build_run
from trainfit.tasks.base import to_device
from trainfit.units import fmt_bytes
from trainfit.vocabulary import (
    PART_LABELS,
    PARTS,
    Dtype,
    PrecisionName,
    StrategyName,
    parse_checkpoint_policy,
    precision_facts,
    refusal,
)

MARGIN = 0.05
"""Share of the cap kept free when judging a change from the estimate (it is within 3% of measured on the
built-ins: ``tests/levers/test_selective_checkpointing.py``)."""

LEVER_ORDER = ("checkpointing selective", "micro-batch / 2", "checkpointing full", "micro-batch / 4",
               str(PrecisionName.BF16_MIXED), str(StrategyName.ZERO2), str(StrategyName.ZERO3),
               str(PrecisionName.BF16_TRUE), "micro-batch / 8")
"""Changes tried, cheapest in step time first: selective recomputes only a few matmuls; halving the
micro-batch keeps the FLOPs but runs smaller matmuls; full recomputes a forward of every block (~+33%);
half precisions change the numerics; sharding needs several devices and adds traffic; bf16-true also keeps
fp32 master copies. Combinations (micro-batch with checkpointing full) follow when no single change fits."""


@dataclass(frozen=True, kw_only=True)
class Change:
    """One lever applied to the failing configuration, priced by the estimator."""

    lever: str
    """A name of :data:`LEVER_ORDER` (or two joined by " + ")."""
    flags: tuple[str, ...]
    """The exact flags that apply it (the global batch kept)."""
    peak_bytes: int
    """Estimated peak of one step with it."""
    frees_bytes: int
    """Estimated peak of the failing configuration minus this one."""
    fits: bool


MIN_PRICED = 3
"""Levers priced at least (cheapest first) even when the first fits: the paragraph shows alternatives."""


def candidate_configs(cfg: RunConfig, devices: int, *, divisors: tuple[int, ...] = (2,)
                      ) -> list[tuple[str, tuple[str, ...], RunConfig]]:
    """(lever, flags, config) for each single change of :data:`LEVER_ORDER` that applies to ``cfg`` (pure);
    the micro-batch divided by each of ``divisors``."""
    out = []
    mb, acc = int(cfg.micro_batch), cfg.accumulation
    for div in divisors:
        if mb % div == 0:
            flags = ("--micro-batch", str(mb // div), "--accumulation", str(acc * div))
            out.append((f"micro-batch / {div}", flags,
                        dataclasses.replace(cfg, micro_batch=mb // div, accumulation=acc * div, global_batch=0)))
    for spec in ("selective", "full"):
        if cfg.checkpointing.spec not in (spec, "full"):
            out.append((f"checkpointing {spec}", ("--checkpointing", spec),
                        dataclasses.replace(cfg, checkpointing=parse_checkpoint_policy(spec))))
    for p in (PrecisionName.BF16_MIXED, PrecisionName.BF16_TRUE):
        if precision_facts(cfg.precision).compute == Dtype.FP32 and refusal(cfg.strategy, p) is None:  # its row
            out.append((str(p), ("--precision", str(p)), dataclasses.replace(cfg, precision=p)))
    if devices > 1:
        for s in (StrategyName.ZERO2, StrategyName.ZERO3):
            if cfg.strategy != s and refusal(s, cfg.precision) is None:
                out.append((str(s), ("--strategy", str(s)), dataclasses.replace(cfg, strategy=s)))
    return out


def rank_changes(changes: list[Change]) -> Change | None:
    """The smallest change that fits (pure): the first fitting one in :data:`LEVER_ORDER`, combinations last."""
    order = {name: i for i, name in enumerate(LEVER_ORDER)}
    fitting = [c for c in changes if c.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda c: (" + " in c.lever, order.get(c.lever, len(order)), c.peak_bytes))


def _estimate(cfg: RunConfig, devices: int):
    strategy = cfg.strategy if devices > 1 else StrategyName.SINGLE
    with inner():  # pricing a lever for the error's advice: no progress lines before the one error
        return estimate_memory(cfg, world_size=devices, strategy=strategy)


ACTIVATION_LEVERS = ("micro-batch", "checkpointing")
"""Levers that change activations only: they cannot fit a model whose state (parameters, gradients,
optimizer) alone exceeds the cap, so they are not estimated then."""


def price_changes(cfg: RunConfig, cap_bytes: int, devices: int = 1) -> tuple[int, list[Change]]:
    """(estimated peak of ``cfg``, each lever's change priced against ``cap_bytes``)."""
    report = _estimate(cfg, devices)
    base = report.peak_bytes
    state = report.params_bytes + report.grads_bytes + report.optimizer_bytes
    limit = cap_bytes * (1.0 - MARGIN)
    changes: list[Change] = []

    def price(lever: str, flags: tuple[str, ...], c: RunConfig) -> None:
        if lever.startswith(ACTIVATION_LEVERS) and state > limit:
            return  # the model state alone is over the cap: an activation lever cannot fit it
        peak = _estimate(c, devices).peak_bytes
        changes.append(Change(lever=lever, flags=flags, peak_bytes=peak, frees_bytes=base - peak, fits=peak <= limit))

    order = {name: i for i, name in enumerate(LEVER_ORDER)}
    singles = sorted(candidate_configs(cfg, devices), key=lambda x: order.get(x[0], len(order)))
    for lever, flags, c in singles:  # cheapest first; stop once one fits and MIN_PRICED are priced
        if any(ch.fits for ch in changes) and len(changes) >= MIN_PRICED:
            break
        price(lever, flags, c)
    if not any(ch.fits for ch in changes):  # no single lever: smaller micro-batches, then with full checkpointing
        for lever, flags, c in candidate_configs(cfg, devices, divisors=(4, 8)):
            if lever.startswith("micro-batch"):
                price(lever, flags, c)
    if not any(ch.fits for ch in changes) and cfg.checkpointing.spec != "full":
        full = parse_checkpoint_policy("full")
        for lever, flags, c in candidate_configs(cfg, devices, divisors=(2, 4, 8)):
            if lever.startswith("micro-batch"):
                price(f"{lever} + checkpointing full", (*flags, "--checkpointing", "full"),
                      dataclasses.replace(c, checkpointing=full))
    return base, changes


def snapshot(cfg: RunConfig, *, step: int = 1) -> dict:
    """Replay the failing step on a fresh run under a classifying tracker with the same cap (on CUDA the
    device's own limit) and label what was live when it ran out. A failure after the first step is replayed
    after one untracked step (the optimizer state exists from then on), then tracked."""
    gc.collect()  # the failed run sits in reference cycles: free its memory before building another
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    run = build_run(cfg)
    mb = to_device(example_batch(run.task, int(cfg.micro_batch)), run.strategy.device)
    mbs = [mb] * cfg.accumulation
    tracker = None
    try:
        if step > 1:
            run.step(mbs)  # uncapped: it fitted in the run too
        for _ in range(2):
            # Lazy sweeps (cheap); the cap check sweeps before it raises, so the parts are exact at that moment.
            tracker = new_tracker(run, cap_bytes=cfg.memory_cap, exact=False)
            tracked_step(run, mbs, tracker)
    except torch.OutOfMemoryError:
        t = tracker
        parts = {p: int(t.totals[p]) for p in PARTS}
        host = {p: int(t.host_totals.get(p, 0)) for p in PARTS} if hasattr(t, "host_totals") else {}
        return {"reproduced": True, "phase": t._current_phase(), "live_bytes": int(t.live_bytes), "parts": parts,
                "device_bytes": {p: parts[p] - host.get(p, 0) for p in PARTS}, "host_bytes": host,
                "top_modules": [list(x) for x in fold_modules(t.module_activation_bytes,
                                                              run.task.block_names(run.model))]}
    finally:
        del run
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"reproduced": False, "phase": None, "live_bytes": int(tracker.peak_bytes),
            "parts": {p: int(tracker.peak_parts[p]) for p in PARTS}, "device_bytes": {}, "host_bytes": {},
            "top_modules": []}


def paragraph(levers: LeversSection, snap: dict, cap_bytes: int, base_peak: int, changes: list[Change],
              best: Change | None, where: str) -> str:
    """The one-paragraph explanation (pure)."""
    parts = snap["parts"]
    full = max(PARTS, key=lambda p: parts[p])
    at = f"in {snap['phase']}" if snap.get("phase") else "(not reproduced on replay; parts at its peak)"
    top = snap.get("top_modules") or []
    tops = f"; top modules by activations: {', '.join(f'{n} {fmt_bytes(b)}' for n, b in top[:3])}" if top else ""
    split = ", ".join(f"{PART_LABELS[p]} {fmt_bytes(parts[p])}" for p in PARTS)
    out = [f"out of memory {at} at micro-batch {levers.micro_batch} x accumulation {levers.accumulation} "
           f"(cap {fmt_bytes(cap_bytes)}): {fmt_bytes(snap['live_bytes'])} live = {split}; fullest: "
           f"{PART_LABELS[full]}{tops}."]
    priced = "; ".join(f"{c.lever} frees {fmt_bytes(max(c.frees_bytes, 0))} (peak {fmt_bytes(c.peak_bytes)})"
                       for c in changes)
    out.append(f"Estimated for this model and shape (step peak {fmt_bytes(base_peak)}): {priced}.")
    if best is not None:
        out.append(f"Smallest change that fits under the cap, global batch kept "
                   f"({int(levers.micro_batch) * levers.accumulation} samples per rank per step): "
                   f"{' '.join(best.flags)}.")
    else:
        out.append("No change tried fits: see `trainfit plan` (more devices, a sharding strategy, offload).")
    out.append(where)
    return " ".join(out)


def device_cap(run: RunSection) -> int:
    """The limit that was hit: ``memory_cap``, else the CUDA device's memory (0 when unknown)."""
    if run.memory_cap:
        return run.memory_cap
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return 0


def explain_oom(cfg: RunConfig, *, micro_batch: int, accumulation: int, step: int, devices: int = 1) -> str:
    """Snapshot, price and explain an out-of-memory of ``cfg`` at that split; writes ``RUN_DIR/oom.json``.

    Returns:
        The paragraph (one line: the CLI prints it as its error).
    """
    failing = dataclasses.replace(cfg, micro_batch=micro_batch, accumulation=accumulation, global_batch=0)
    cap = device_cap(failing.section("run"))
    snap = snapshot(failing, step=step) if devices == 1 else {"reproduced": False, "phase": None, "live_bytes": 0,
                                                   "parts": dict.fromkeys(PARTS, 0), "device_bytes": {},
                                                   "host_bytes": {}, "top_modules": []}
    base, changes = price_changes(failing, cap, devices)
    best = rank_changes(changes)
    path = Path(cfg.run_dir) / "oom.json"
    record = {"step": step, "micro_batch": micro_batch, "accumulation": accumulation, "cap_bytes": cap,
              **snap, "estimated_peak_bytes": base,
              "levers": [dataclasses.asdict(c) for c in changes],
              "fits": list(best.flags) if best else None}
    where = f"Snapshot: {path}."
    if not path.parent.is_dir():  # stopped before its first step: like any refused run, it leaves no directory
        where = "No snapshot written: the run stopped before its first step, so it leaves no run directory."
    else:
        try:
            atomic_write_bytes(path, (json.dumps(mark_non_finite(record), indent=1) + "\n").encode())
        except TrainfitError as e:  # the explanation still prints; the disk error concerns the snapshot only
            where = f"No snapshot written: {e}."
    return paragraph(failing.section("levers"), snap, cap, base, changes, best, where)


__all__ = ["Change", "LEVER_ORDER", "MARGIN", "candidate_configs", "explain_oom", "paragraph", "price_changes",
           "rank_changes", "snapshot"]
