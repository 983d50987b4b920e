"""Measured memory: run real optimizer steps and account every live storage of the second.

``measure_memory(cfg)`` builds the run exactly as training does (``build_run``: task,
checkpointing, precision, strategy, optimizer), runs one warm-up step so the optimizer
state exists, then runs the step again under :class:`MemoryTracker` through the same
``run.step`` that training uses -- so every precision and checkpointing
policy is measured as it really runs. The step does not know it is measured.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import trainfit.logs as logs
from trainfit.config import RunConfig
from trainfit.errors import ConfigError
from trainfit.meters.tracker import MemoryTracker, memory_cap
from trainfit.progress import logger, say
from trainfit.results import MemoryReport, fold_modules, precision_notes
from trainfit.run import Run, build_run
from trainfit.tasks.base import to_device

_WARMUP_TRIES = 8  # fp16 may skip the first steps on overflow; optimizer state needs one real step

log = logger("memory")


def with_batch(cfg: RunConfig, batch: Any) -> tuple[RunConfig, Any]:
    """``batch`` may be an int (micro-batch size override), a batch object, or None."""
    if batch is None or (isinstance(batch, int) and not isinstance(batch, bool)):
        if batch is not None:
            if batch < 1:
                raise ConfigError("batch", batch, "an integer >= 1")
            cfg = dataclasses.replace(cfg, micro_batch=batch)
        if cfg.micro_batch == "auto":
            raise ConfigError("micro_batch", "auto", "a number for memory accounting", "pass --batch N")
        return cfg, None
    return cfg, batch


def example_batch(task, n: int) -> Any:
    """A worst-case micro-batch of ``n`` samples: the task's ``example_batch(n)`` if it has one
    (full-length sequences), else the first ``n`` samples of its dataset, collated."""
    make = getattr(task, "example_batch", None)
    if callable(make):
        return make(n)
    ds = task.dataset()
    if len(ds) < n:
        raise ConfigError("micro_batch", n, f"at most the dataset size {len(ds)}")
    return task.collate([ds[i] for i in range(n)])


def batch_size_of(batch: Any) -> int:
    for leaf in torch.utils._pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def tracked_step(run: Run, micro_batches: Sequence[Any], tracker: MemoryTracker,
                 on_micro_batch: Callable[[int], None] | None = None) -> None:
    """One ``run.step`` under ``tracker``, labelling phases forward/backward/optimizer.

    The phase is set from outside the step: forward while the task's loss runs, backward
    from the loss until autograd's last backward of the window ends, optimizer after.
    ``on_micro_batch(j)`` is called as micro-batch ``j`` of the window starts (the estimator
    labels its segments with it).
    """
    n = len(micro_batches)
    state = {"calls": 0, "in_backward_seen": False}

    def loss_fn(model, mb):
        if on_micro_batch is not None:
            on_micro_batch(state["calls"])
        tracker.set_phase("forward")
        out = run.task.loss(model, mb)
        state["calls"] += 1
        state["in_backward_seen"] = False
        tracker.set_phase("backward")  # the scaled-loss multiply, then autograd
        return out

    def watch(tr: MemoryTracker) -> None:
        if torch._C._current_graph_task_id() != -1:
            state["in_backward_seen"] = True
        elif state["calls"] == n and state["in_backward_seen"] and tr.phase == "backward":
            tr.set_phase("optimizer")

    tracker.listeners.append(watch)
    try:
        with tracker:
            run.step(micro_batches, loss_fn=loss_fn)
    finally:
        tracker.listeners.remove(watch)


def warm_up(run: Run, micro_batches: Sequence[Any], *, loss_fn: Callable | None = None) -> None:
    """Step until the optimizer has taken one real step (its state exists); ``loss_fn``: as :meth:`Run.step`'s."""
    for _ in range(_WARMUP_TRIES):
        if run.step(micro_batches, loss_fn=loss_fn).stepped:
            return


def new_tracker(run: Run, **kw) -> MemoryTracker:
    tracker = MemoryTracker(**kw)
    tracker.register_run(run.model, run.optimizer, run.optimizer_params())
    return tracker


def build_report(run: Run, tracker: MemoryTracker, *, method: str, batch: int, masters: Sequence[torch.Tensor],
                 wall_s: float, device_stats: tuple[int | None, int | None] = (None, None),
                 details: dict | None = None) -> MemoryReport:
    cfg = run.cfg
    seen: set[int] = set()
    n_params = 0
    for p in run.model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n_params += p.numel()
    master_bytes = sum(m.untyped_storage().nbytes() for m in masters)
    pm = tracker.part_max
    return MemoryReport(
        method=method, model=cfg.model, precision=cfg.precision, checkpointing=cfg.checkpointing.spec,
        optimizer=cfg.optimizer, batch=batch, seq_len=cfg.seq_len, accumulation=cfg.accumulation,
        n_params=n_params, params_bytes=pm["params"], grads_bytes=pm["grads"], optimizer_bytes=pm["optimizer"],
        master_weights_bytes=master_bytes, activations_bytes=pm["activations"],
        temporaries_bytes=tracker.peak_parts["temporaries"], peak_bytes=tracker.peak_bytes,
        peak_phase=tracker.peak_phase, peak_parts=dict(tracker.peak_parts),
        phases={k: dict(v) for k, v in tracker.phase_peaks.items() if k != "setup"},
        top_modules=fold_modules(tracker.module_activation_bytes, run.task.block_names(run.model)),
        notes=precision_notes(cfg.precision, n_params, pm["params"], master_bytes),
        device_max_allocated_bytes=device_stats[0], device_max_reserved_bytes=device_stats[1],
        wall_s=wall_s, details=details or {}, strategy=str(cfg.strategy), world_size=run.strategy.world_size,
        **tracker.host_split())  # --offload: what stays on the device and what sits in host memory


def masters_of(run: Run) -> list[torch.Tensor]:
    params = {id(p) for p in run.model.parameters()}
    return [t for t in run.optimizer_params() if id(t) not in params]


def measure_memory(cfg: RunConfig, *, batch: Any = None, run: Run | None = None) -> MemoryReport:
    """Measure one real optimizer step (the second) and account every live storage.

    Args:
        cfg: the run configuration (model, precision, checkpointing, optimizer, accumulation).
        batch: None (a worst-case batch of ``cfg.micro_batch`` samples), an int (that many
            samples instead), or a ready micro-batch for the task.
        run: an already built run (advanced; ``build_run(cfg)`` otherwise).
    Returns:
        A :class:`MemoryReport` with method="measured".

    Progress goes to the ``trainfit.memory`` logger (:mod:`trainfit.progress`); once the warm-up step has run, the
    job is accepted (``trainfit.logs.accept``: a held stderr prints what it held and writes through).
    """
    t0 = time.perf_counter()
    cfg, given = with_batch(cfg, batch)
    if run is None:
        say(log, "memory: building the run (%s, %s, checkpointing %s, %s) ...", cfg.model, cfg.precision,
            cfg.checkpointing.spec, cfg.optimizer)
        run = build_run(cfg)
    mb = given if given is not None else example_batch(run.task, cfg.micro_batch)
    mb = to_device(mb, run.strategy.device)
    micro_batches = [mb] * cfg.accumulation
    shape = f"micro-batch {batch_size_of(mb)} x accumulation {cfg.accumulation}"
    say(log, "memory: warm-up step (%s) so that the optimizer state exists ...", shape)
    warm_up(run, micro_batches)  # its leftovers are freed by refcount; no gc.collect (slow with HF loaded)
    logs.accept()  # the run is built and steps: what was held on stderr prints, progress writes through
    say(log, "memory: measuring one step (%s) under the memory tracker ...", shape)
    cuda = run.strategy.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tracker = new_tracker(run)
    tracked_step(run, micro_batches, tracker)
    stats: tuple[int | None, int | None] = (None, None)
    if cuda:
        stats = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
    report = build_report(run, tracker, method="measured", batch=batch_size_of(mb), masters=masters_of(run),
                          wall_s=time.perf_counter() - t0, device_stats=stats)
    say(log, "memory: measured in %.1f s: peak %s bytes in %s", report.wall_s, f"{report.peak_bytes:,}",
        report.peak_phase)
    return report


__all__ = ["measure_memory", "memory_cap", "MemoryTracker", "tracked_step", "example_batch"]
