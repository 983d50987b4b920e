"""The training loop: build, (resume), step, evaluate, log, checkpoint, export.

    for each step: micro-batches -> run.step -> [evaluate every eval_every] -> log -> [checkpoint] -> [export]
    at the end:    evaluate (eval_every > 0), checkpoint, export RUN_DIR/model

Progress goes to stderr; ``metrics.jsonl`` in the run directory gets one line per step (and TensorBoard
event files with ``--log tensorboard``, :mod:`trainfit.logs`). A checkpoint is written every
``checkpoint_every`` steps or ``checkpoint_minutes`` minutes, whichever comes first, so a killed run loses
little by default. Evaluation leaves the training RNG stream and data order untouched: a resumed run with
evaluation on is bitwise the uninterrupted one.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

import trainfit.logs as logs
import trainfit.progress as progress_log  # (train()'s `progress` flag is another thing)
from trainfit.checkpoint import (
    atomic_write_bytes,
    check_resumable,
    list_checkpoints,
    restore_rng,
    resume_record,
    rng_state,
)
from trainfit.config import LeversSection, RunConfig, RunSection, dump_toml
from trainfit.engine import StepResult, evaluate
from trainfit.errors import CheckpointError, ConfigError, TrainingStopped
from trainfit.export import export_model
from trainfit.gate import RECORD, read_document
from trainfit.levers.autofit import Fitter, resolve_auto
from trainfit.meters.timers import PhaseTimer
from trainfit.outputs import check_run_dir, claim_run_dir
from trainfit.results import TrainSummary
from trainfit.run import Run, build_run
from trainfit.strategies import Strategy, fit_to_world, make_strategy
from trainfit.strategies.dist_checkpoint import META, has_checkpoints, list_dcp
from trainfit.tasks.base import to_device
from trainfit.tasks.corpus import reads_under
from trainfit.tasks.make import is_user_model
from trainfit.tasks.spec import DataSpec

log = progress_log.logger("train")


Summary = TrainSummary
"""The loop's summary: the typed report ``trainfit train --json`` prints (``results.TrainSummary``)."""


def _progress(total: int, initial: int, enabled: bool):
    """The step bar on stderr; off where asked, and where the ``trainfit`` logger is set above INFO (``--quiet``)."""
    return tqdm(total=total, initial=initial, disable=not (enabled and progress_log.bars_enabled()), file=sys.stderr,
                unit="step", dynamic_ncols=True)


def _say(rank: int, message: str, *args) -> None:
    """A startup line on the ``trainfit.train`` logger, from rank 0 only (every rank builds the same run)."""
    if rank == 0:
        progress_log.say(log, message, *args)


def check_outside_data(cfg: RunConfig, run_dir: Path) -> None:
    """Refuse a run directory that ``--data`` or ``--val-data`` reads: the next read would train on the run's own
    checkpoints, logs and exported model."""
    for key in ("data", "val_data"):
        spec = getattr(cfg, key)
        if spec and reads_under(spec, run_dir):
            raise ConfigError("run_dir", str(run_dir), f"a directory the {key} ({spec}) does not read",
                              "a run inside its own data would read its checkpoints and logs as documents")


def train(cfg: RunConfig, *, resume: bool = False, progress: bool = True, strategy: Strategy | None = None) -> TrainSummary:
    """Train ``cfg`` to ``cfg.steps``; with ``resume``, from the newest checkpoint in its run directory.

    Raises:
        CheckpointError: ``resume`` and no checkpoint to resume from.
        ConfigError: bad settings (before any work), e.g. ``--log tensorboard`` without the package.
        TrainingStopped: non-finite loss or an overflow storm; the last good checkpoint is kept.
    """
    logs.check_available(cfg.log)  # before any work: a missing optional package is one line
    strategy = strategy or make_strategy(cfg)
    run_dir = Path(cfg.run_dir)
    if strategy.rank == 0 and not (resume and has_checkpoints(run_dir)):  # (a run from before the marker resumes)
        check_run_dir(run_dir)  # before any work: never into a directory of the user's own files
        check_outside_data(cfg, run_dir)
    auto = cfg.micro_batch == "auto"
    cfg = resolve_auto(cfg, strategy.world_size)  # "auto" -> the starting split; auto-fit shrinks it
    cfg = fit_to_world(cfg, strategy.world_size)  # global_batch -> accumulation per rank
    cfg = with_data_tokenizer(cfg)  # the tokenizer the data is read with, as config.toml records it
    if resume:  # before the data is read or anything is built: another job's checkpoint is refused here
        check_resume(cfg, strategy.world_size)
    t0 = time.perf_counter()
    _say(strategy.rank, "train: building the model and reading the data (%s, %s, %s, micro-batch %s x accumulation "
         "%s on %d rank(s)) ...", cfg.model, cfg.precision, cfg.strategy, cfg.micro_batch, cfg.accumulation,
         strategy.world_size)
    run = build_run(cfg, strategy=strategy)
    st = run.strategy
    _say(st.rank, "train: built in %.1f s", time.perf_counter() - t0)
    start = 0
    if resume:
        _say(st.rank, "train: loading the newest checkpoint of %s ...", run_dir)
        start = run.load(run_dir)  # the newest checkpoint, one-file or sharded (these load into any strategy)
        if start is None:
            raise CheckpointError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}; run without --resume "
                                  "first, or pass --resume auto to start fresh when there is none")
        if start >= cfg.steps:
            raise ConfigError("steps", cfg.steps, f"an integer > {start}, the step the checkpoint reached",
                              f"{run_dir} is already at step {start}; pass --steps N with N > {start} to train on")
    else:
        refuse_checkpoints(run_dir)
    created = not run_dir.exists()
    try:
        return _loop(cfg, run, run_dir, start=start, auto=auto, progress=progress)
    except BaseException:
        if st.rank == 0 and created:
            remove_if_unstarted(run_dir)
        raise


def with_data_tokenizer(cfg: RunConfig) -> RunConfig:
    """``cfg`` naming the tokenizer its data is read with (:func:`~trainfit.tasks.spec.resolve_tokenizer`: the
    one given, else the model's own, else a prepared directory's, else byte); unchanged without ``--data``.

    Raises:
        ConfigError: naming ``tokenizer`` (a prepared directory made with another tokenizer than the model's).
    """
    spec = DataSpec.from_config(cfg)
    return cfg if spec is None else replace(cfg, tokenizer=spec.tokenizer)


def check_resume(cfg: RunConfig, world_size: int) -> None:
    """Refuse to resume ``cfg.run_dir`` with another job on ``world_size`` ranks
    (:func:`~trainfit.checkpoint.check_resumable`: the model, the schedule, the global batch, the data's
    identity), reading only what its newest checkpoint recorded: nothing is loaded, built or written first (the
    ``--devices N`` launcher calls it before starting a worker). A checkpoint that recorded nothing is checked
    when it loads.

    Raises:
        CheckpointError: naming the first field that differs, both values and what to do.
        ConfigError: the data cannot be found, or its tokenizer is refused (naming the field).
    """
    found = recorded_job(Path(cfg.run_dir))
    if found is not None:
        path, saved, saved_world = found
        cfg = with_data_tokenizer(fit_to_world(resolve_auto(cfg, world_size), world_size))  # as train() runs it
        check_resumable(saved, saved_world, resume_record(cfg), world_size, path)


def recorded_job(run_dir: Path) -> tuple[Path, dict, int] | None:
    """(checkpoint, its recorded config, its world size) of the newest checkpoint in ``run_dir`` -- the one a
    resume loads: the newest sharded one unless a one-file one is newer -- or None when it recorded none."""
    sharded, single = list_dcp(run_dir), list_checkpoints(run_dir)
    if not (sharded or single):
        return None
    is_sharded = bool(sharded) and (not single or sharded[-1].stem >= single[-1].stem)  # step-00000050: zero-padded
    path = sharded[-1] if is_sharded else single[-1]
    try:
        meta = read_document(path / META if is_sharded else path.with_suffix(".json"), field="checkpoint",
                             fmt="json", limits=RECORD, error=CheckpointError)  # bounded: nesting, size
        saved, world = meta.get("config"), int(meta.get("world_size", 1))  # a .pt is written by one process
    except (CheckpointError, ValueError, TypeError, AttributeError):
        return None  # unreadable: the load says why
    return (path, saved, world) if isinstance(saved, dict) else None


def refuse_checkpoints(run_dir: Path) -> None:
    """A run that does not resume must not start over the checkpoints of another."""
    if has_checkpoints(run_dir):
        raise ConfigError("run_dir", str(run_dir), "a directory without checkpoints",
                          "pass --resume to continue it, or choose a new --run-dir")


def remove_if_unstarted(run_dir: Path) -> None:
    """Remove a run directory this invocation created when the run failed before its first step (no checkpoint,
    nothing logged): a refused run leaves nothing behind."""
    log = run_dir / "metrics.jsonl"
    if not has_checkpoints(run_dir) and not (log.is_file() and log.stat().st_size):
        shutil.rmtree(run_dir, ignore_errors=True)


def _loop(cfg: RunConfig, run: Run, run_dir: Path, *, start: int, auto: bool, progress: bool) -> TrainSummary:
    """Steps ``start + 1 .. cfg.steps`` of ``run``, then the summary. Each step: the micro-batches, the optimizer
    step, the health check, its metrics line (with evaluation when due), the bar, a checkpoint or export when due."""
    st = run.strategy
    levers, run_section = cfg.section("levers"), cfg.section("run")  # built once here, read every step
    val = _val_batches(levers, run_section, run)  # before any step: a missing or empty split is refused first
    _open_run_dir(cfg, run_dir, st.rank)
    fit = Fitter(run, start_step=start, auto=auto)  # owns the loader; re-cuts a step on out-of-memory
    metrics, board = _open_logs(run_section, run_dir, start=start, rank=st.rank)
    held = _accept_unless_user_model(cfg.model)
    _say(st.rank, "train: step %d of %d next%s ...", start + 1, cfg.steps,
         " (it compiles the graphs: --compile)" if run.compiled else "")
    bar = _progress(cfg.steps, start, progress and st.rank == 0)
    s = _LoopState.begin(run, run_dir, start)
    cuda = st.device.type == "cuda"
    timer = PhaseTimer(st.device)  # per-step breakdown for metrics.jsonl (a few perf_counter calls)
    s.t_start = s.last_save = time.perf_counter()
    try:
        for step in range(start, cfg.steps):
            done = step + 1
            lr = run.current_lr()  # the rate this step uses (the schedule moves it after the step)
            if cuda:
                torch.cuda.reset_peak_memory_stats(st.device)
            t0 = time.perf_counter()
            mbs = fit.micro_batches()  # blocks on the loader
            t1 = time.perf_counter()
            mbs = [to_device(mb, st.device) for mb in mbs]
            shrinks = len(fit.events)
            s.res = res = fit.step(step, mbs, timer=timer)  # optimizer_step, under the memory cap if any
            if held:  # the user's protocol held for a whole step: accepted
                logs.accept()
                held = False
            _say_refits(bar, fit.events[shrinks:], st.rank)
            phases = timer.collect()  # CUDA: one sync per step to read the events
            t2 = time.perf_counter()
            _check_health(levers, run_section, run, res, s.consecutive_skips + (not res.stepped), step)
            s.count(res)
            record = _step_record(run, s, res, done=done, lr=lr, phases=phases, t0=t0, t1=t1, t2=t2, cuda=cuda)
            if val is not None and (done % run_section.eval_every == 0 or done == cfg.steps):
                s.last_val = _evaluate(run, val)
                record.update(s.last_val)
            _write_record(metrics, board, done, record)
            _show_step(bar, run, s, record)
            _checkpoint_and_export(run, run_section, s, done, steps=cfg.steps, run_dir=run_dir)
    finally:
        fit.close()  # DataLoader workers stop here, not at the next garbage collection
        bar.close()
        board.close()
        if metrics:
            metrics.close()
    return _summary(levers, cfg.steps, run, run_dir, s, wall=time.perf_counter() - s.t_start)


def _open_run_dir(cfg: RunConfig, run_dir: Path, rank: int) -> None:
    """Rank 0 claims the run directory (train() checked it, or found checkpoints to resume) and writes
    config.toml there; the other ranks only make sure it exists."""
    if rank == 0:
        claim_run_dir(run_dir, checked=True)
        (run_dir / "config.toml").write_text(dump_toml(cfg))
    else:
        run_dir.mkdir(parents=True, exist_ok=True)


def _open_logs(run_section: RunSection, run_dir: Path, *, start: int, rank: int):
    """(metrics.jsonl opened to append on rank 0, else None; the ``--log`` sink: TensorBoard on rank 0, or
    nothing). The log is first cut back to steps ``1..start`` (a resumed run redoes the steps after it)."""
    if rank == 0:
        _trim_metrics(run_dir / "metrics.jsonl", start)
    metrics = open(run_dir / "metrics.jsonl", "a") if rank == 0 else None  # noqa: SIM115 -- _loop closes it
    return metrics, logs.open_log(run_section.log, run_dir, start=start, rank=rank)


def _accept_unless_user_model(model: str) -> bool:
    """Everything is checked: the lines held on stderr (data, tokenizer, warnings) print now -- except for a
    user's module:callable, whose protocol its first step checks (a break there is a refusal: one line alone).
    True while they stay held."""
    held = is_user_model(model)
    if not held:
        logs.accept()
    return held


@dataclass(slots=True, kw_only=True)
class _LoopState:
    """What the loop carries from step to step and reports in the summary (this invocation's counts; the log's
    ``skipped_steps`` is cumulative over resumes)."""

    skipped_before: int
    """Steps skipped by the run being resumed, up to its checkpoint."""
    graphs: int
    """Graphs compiled so far (``--compile``)."""
    res: StepResult | None = None
    first_loss: float = math.nan
    last_val: dict = field(default_factory=dict)
    skipped: int = 0
    consecutive_skips: int = 0
    items: int = 0
    model_dir: Path | None = None
    t_start: float = 0.0
    last_save: float = 0.0
    compile_steps: list[float] = field(default_factory=list)
    """Seconds of the steps that compiled a graph (``--compile``)."""
    steady_steps: list[float] = field(default_factory=list)
    graphs_first: int | None = None

    @classmethod
    def begin(cls, run: Run, run_dir: Path, start: int) -> _LoopState:
        """The state before step ``start + 1``: the skips the resumed run's log counted (rank 0 reads them)."""
        skipped_before = _skipped_before(run_dir / "metrics.jsonl", start) if run.strategy.rank == 0 else 0
        return cls(skipped_before=skipped_before, graphs=run.compiled.graphs() if run.compiled else 0)

    def count(self, res: StepResult) -> None:
        """Count a finished step: skipped (overflow) or not, its items, the first loss."""
        self.skipped += not res.stepped
        self.consecutive_skips = 0 if res.stepped else self.consecutive_skips + 1
        self.items += res.count
        if math.isnan(self.first_loss):
            self.first_loss = res.loss


def _say_refits(bar, events: list[dict], rank: int) -> None:
    """Auto-fit names what it changed (rank 0, above the bar)."""
    if rank != 0:
        return
    for ev in events:
        bar.write(f"trainfit: auto-fit: out of memory in step {ev['step']}: micro-batch {ev['from'][0]} x "
                  f"accumulation {ev['from'][1]} -> {ev['to'][0]} x {ev['to'][1]} (global batch kept)",
                  file=sys.stderr)


def _step_record(run: Run, s: _LoopState, res: StepResult, *, done: int, lr: float, phases: dict, t0: float,
                 t1: float, t2: float, cuda: bool) -> dict:
    """The step's metrics.jsonl line (evaluation is added to it when due): the step started at ``t0``, had its
    micro-batches at ``t1`` and finished at ``t2``. Counts the graphs compiled during it (``--compile``)."""
    rate = res.count / max(t2 - t0, 1e-9)
    data_frac = (t1 - t0) / max(t2 - t0, 1e-9)
    record = {
        "step": done, "loss": res.loss, "count": res.count, "stepped": res.stepped,
        "skipped_steps": s.skipped_before + s.skipped, "lr": lr,
        "loss_scale": res.loss_scale, "grad_norm": res.grad_norm, "step_s": t2 - t0,
        "data_wait_s": t1 - t0, "data_wait_frac": data_frac, f"{run.task.unit}_per_s": rate,
        **{f"{k}_s": v for k, v in phases.items()},  # forward, backward[_sync], optimizer
    }
    if run.compiled:  # graphs compiled during this step: >0 at the first step, then 0 (a recompile)
        now = run.compiled.graphs()
        record["compile_graphs"], s.graphs = now - s.graphs, now
        (s.compile_steps if record["compile_graphs"] else s.steady_steps).append(t2 - t0)
        s.graphs_first = s.graphs if s.graphs_first is None else s.graphs_first
    if cuda:  # CPU has no allocator peak to read (the memory probe measures it there)
        record["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(run.strategy.device)
    return record


def _write_record(metrics, board, done: int, record: dict) -> None:
    """The step's line to metrics.jsonl (rank 0, flushed: a killed run keeps it) and to the ``--log`` sink."""
    if metrics:
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()
    board.write(done, record)


def _show_step(bar, run: Run, s: _LoopState, record: dict) -> None:
    """The step on the progress bar: loss, last validation loss, compile time, rate, data wait, scale, lr."""
    unit = run.task.unit
    shown = f" val={s.last_val['val_loss']:.4f}" if s.last_val else ""
    shown += f" compile={sum(s.compile_steps):.1f}s" if run.compiled else ""
    bar.set_postfix_str(f"loss={record['loss']:.4f}{shown} {unit}/s={record[unit + '_per_s']:,.0f} "
                        f"data={record['data_wait_frac']:.0%} scale={record['loss_scale']:g} lr={record['lr']:.3g}",
                        refresh=False)
    bar.update(1)


def _checkpoint_and_export(run: Run, run_section: RunSection, s: _LoopState, done: int, *, steps: int,
                           run_dir: Path) -> None:
    """After step ``done`` of ``steps``: a checkpoint when due (:func:`checkpoint_due`), the model exported to
    RUN_DIR/model after the last step and every ``save_every`` steps (a collective: every rank calls it)."""
    by_time = _minutes_passed(run_section, run.strategy, time.perf_counter() - s.last_save)
    if checkpoint_due(done, steps=steps, every=run_section.checkpoint_every, by_time=by_time):
        run.save(done)
        s.last_save = time.perf_counter()
    if done == steps or (run_section.save_every and done % run_section.save_every == 0):
        s.model_dir = export_model(run, run_dir / "model")


def _summary(levers: LeversSection, steps: int, run: Run, run_dir: Path, s: _LoopState, *,
             wall: float) -> TrainSummary:
    """The loop's summary after ``wall`` seconds (:class:`~trainfit.results.TrainSummary`)."""
    return TrainSummary(steps=steps, final_loss=s.res.loss if s.res else math.nan, first_loss=s.first_loss,
                        skipped_steps=s.skipped, items_per_s=s.items / max(wall, 1e-9),
                        effective_batch=levers.micro_batch * levers.accumulation * run.strategy.world_size,
                        unit=run.task.unit, run_dir=str(run_dir), wall_s=wall, val_loss=s.last_val.get("val_loss"),
                        val_perplexity=s.last_val.get("val_perplexity"),
                        model_dir=str(s.model_dir) if s.model_dir is not None else None,
                        **_compile_summary(run, s.compile_steps, s.steady_steps, s.graphs_first))


def _compile_summary(run: Run, compile_steps: list[float], steady_steps: list[float], graphs_first) -> dict:
    """``compile_s`` and ``compile`` of the summary (empty without ``--compile``): compiling steps' wall time
    less the median steady step for each, and the graphs compiled after the first step (recompiles)."""
    if not run.compiled:
        return {}
    steady = sorted(steady_steps)[len(steady_steps) // 2] if steady_steps else 0.0
    info = run.compiled.to_dict()
    info["recompiles_after_first_step"] = info["graphs"] - (graphs_first or 0)
    if not info["graphs"]:  # said, not hidden: the steps may have run eagerly
        info["note"] = (info["note"] + "; " if info["note"] else "") + (
            "no graph was compiled by this run: reused from an earlier compile in this process, or dynamo skipped "
            "the frames (it does while a TorchDispatchMode such as --memory-cap's tracker is active)")
    return {"compile_s": max(0.0, sum(compile_steps) - steady * len(compile_steps)), "compile": info}


# -- checkpoints by steps or by time -------------------------------------------------------------------------

def checkpoint_due(done: int, *, steps: int, every: int, by_time: bool) -> bool:
    """Whether to checkpoint after ``done`` steps (pure): every ``every`` steps, when ``by_time`` (the
    checkpoint_minutes clock ran out), and always after the last step."""
    return done == steps or by_time or bool(every and done % every == 0)


def _minutes_passed(run_section: RunSection, st: Strategy, since_s: float) -> bool:
    """``checkpoint_minutes`` passed since the last checkpoint. Clocks differ between ranks, so with
    several ranks rank 0 decides and the others follow (one all-reduce of one number per step, only when
    the clock is on; on CUDA a host-device sync)."""
    if not run_section.checkpoint_minutes:
        return False
    due = since_s >= run_section.checkpoint_minutes * 60
    if st.world_size == 1:
        return due
    flag = torch.tensor([1.0 if (due and st.rank == 0) else 0.0], device=st.device)
    st.all_reduce_max(flag)
    return bool(flag.item())


# -- evaluation ------------------------------------------------------------------------------------------------

def val_index_batches(n: int, *, micro_batch: int, rank: int, world_size: int, limit: int = 0) -> list[list[int]]:
    """This rank's validation micro-batches as index lists (pure): samples ``0..n-1`` in order, cut into
    ``micro_batch`` rows, batch ``i`` to rank ``i % world_size``. Disjoint shares that cover the split once;
    ``limit`` > 0 keeps each rank's first ``limit`` (the first ``limit x world_size`` batches overall)."""
    cuts = [list(range(i, min(i + micro_batch, n))) for i in range(0, n, micro_batch)]
    mine = cuts[rank::world_size]
    return mine[:limit] if limit else mine


class _LazyBatches(Sequence):
    """Validation micro-batches collated and moved to the device when read (one in memory at a time)."""

    def __init__(self, dataset, collate, index_lists: list[list[int]], device: torch.device) -> None:
        self.dataset, self.collate, self.index_lists, self.device = dataset, collate, index_lists, device

    def __len__(self) -> int:
        return len(self.index_lists)

    def __getitem__(self, i):
        idx = self.index_lists[i]
        return to_device(self.collate([self.dataset[j] for j in idx]), self.device)


@dataclass(frozen=True, kw_only=True)
class _Val:
    batches: _LazyBatches
    filler: _LazyBatches
    """The split's first batch: run (and discarded) by a rank whose share is empty."""


def _val_batches(levers: LeversSection, run_section: RunSection, run: Run) -> _Val | None:
    """This rank's share of the validation split, or None when evaluation is off."""
    if not run_section.eval_every:
        return None
    ds = run.task.val_dataset()
    if ds is None:
        raise ConfigError("eval_every", run_section.eval_every, "0 for a task without a validation split",
                          "pass --val-fraction F or --val-data PATH with --data")
    if len(ds) == 0:
        raise ConfigError("eval_every", run_section.eval_every, "0 with an empty validation split",
                          "raise --val-fraction or give --val-data with at least one document")
    st = run.strategy
    mine = val_index_batches(len(ds), micro_batch=levers.micro_batch, rank=st.rank, world_size=st.world_size,
                             limit=run_section.eval_batches)
    first = val_index_batches(len(ds), micro_batch=levers.micro_batch, rank=0, world_size=1, limit=1)
    return _Val(batches=_LazyBatches(ds, run.task.collate, mine, st.device),
                filler=_LazyBatches(ds, run.task.collate, first, st.device))


def _evaluate(run: Run, val: _Val) -> dict:
    """The validation metrics of the run now. The RNG is saved and restored around it, so a model that
    draws random numbers even in eval mode leaves the training stream as it was (bitwise resume)."""
    rng = rng_state(run.strategy.device)
    try:
        loss_sum, count = evaluate(model=run.model, precision=run.precision, batches=val.batches,
                                   loss_fn=run.task.loss, strategy=run.strategy,
                                   filler=None if len(val.batches) else val.filler[0])
    finally:
        restore_rng(rng, run.strategy.device)
    loss = loss_sum / count if count else math.nan
    return {"val_loss": loss, "val_perplexity": _exp(loss), "val_tokens": count}


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _skipped_before(path: Path, start: int) -> int:
    """Steps skipped up to ``start`` by the run being resumed (its log's last kept line), so the cumulative
    count continues; 0 for a fresh run or an old log without the key."""
    if not start or not path.is_file():
        return 0
    last = 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
            if rec["step"] <= start and isinstance(rec.get("skipped_steps"), int):
                last = rec["skipped_steps"]
        except (ValueError, KeyError, TypeError):
            continue
    return last


def _trim_metrics(path: Path, start: int) -> None:
    """Keep the log of steps 1..start only: after a crash it may hold steps past the checkpoint (they are
    redone) and a line cut mid-write, which the next append would glue to a valid one."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            if json.loads(line)["step"] <= start:
                keep.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    atomic_write_bytes(path, "".join(keep).encode())


def _check_health(levers: LeversSection, run_section: RunSection, run: Run, res: StepResult, consecutive: int,
                  step: int) -> None:
    """Stop rather than train on garbage; the last good checkpoint stays on disk."""
    if not res.stepped and not run.precision.scales_loss:
        raise TrainingStopped(
            f"step {step + 1}: loss or gradients are not finite (loss={res.loss}) with precision={levers.precision}; "
            "stopped before corrupting the weights (lower lr, check the data, or add grad_clip)")
    if consecutive >= run_section.max_consecutive_skips:
        raise TrainingStopped(
            f"step {step + 1}: {consecutive} optimizer steps in a row overflowed in {levers.precision}; likely cause: "
            "activations beyond fp16's range (e.g. a bf16-pretrained model run in fp16) -- use bf16-mixed")
    scale = run.precision.loss_scale
    if run.precision.scales_loss and scale < run_section.min_loss_scale:
        raise TrainingStopped(
            f"step {step + 1}: loss scale {scale:g} fell below min_loss_scale={run_section.min_loss_scale:g}; "
            "gradients overflow fp16 even unscaled -- use bf16-mixed or lower the learning rate")
