"""The training loop: build, (resume), step, log, checkpoint.

Progress goes to stderr; ``metrics.jsonl`` in the run directory gets one line per step.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from trainfit.checkpoint import atomic_write_bytes
from trainfit.config import RunConfig, dump_toml
from trainfit.engine import StepResult
from trainfit.errors import CheckpointError, ConfigError, TrainingStopped
from trainfit.levers.autofit import Fitter, resolve_auto
from trainfit.meters.timers import PhaseTimer
from trainfit.outputs import check_run_dir, claim_run_dir
from trainfit.run import Run, build_run
from trainfit.strategies import Strategy, fit_to_world, make_strategy
from trainfit.strategies.dist_checkpoint import has_checkpoints
from trainfit.tasks.base import to_device


@dataclass(frozen=True, kw_only=True)
class Summary:
    steps: int
    final_loss: float
    first_loss: float
    skipped_steps: int
    items_per_s: float
    """Loss-bearing items per second over the run: tokens for token tasks, samples for sample tasks (``unit``)."""
    effective_batch: int
    unit: str
    """What an item is: "tokens" or "samples"."""
    run_dir: str
    wall_s: float

    def to_dict(self) -> dict:
        """The ``--json`` summary; the rate also under ``<unit>_per_s`` (``tokens_per_s`` or ``samples_per_s``)."""
        d = dict(self.__dict__)
        d[f"{self.unit}_per_s"] = self.items_per_s
        return d


def _progress(total: int, initial: int, enabled: bool):
    return tqdm(total=total, initial=initial, disable=not enabled, file=sys.stderr, unit="step", dynamic_ncols=True)


def train(cfg: RunConfig, *, resume: bool = False, progress: bool = True, strategy: Strategy | None = None) -> Summary:
    strategy = strategy or make_strategy(cfg)
    run_dir = Path(cfg.run_dir)
    if strategy.rank == 0 and not (resume and has_checkpoints(run_dir)):  # (a run from before the marker resumes)
        check_run_dir(run_dir)  # before any work: never into a directory of the user's own files
    auto = cfg.micro_batch == "auto"
    cfg = resolve_auto(cfg, strategy.world_size)  # "auto" -> the starting split; auto-fit shrinks it
    cfg = fit_to_world(cfg, strategy.world_size)  # global_batch -> accumulation per rank
    run = build_run(cfg, strategy=strategy)
    st = run.strategy
    start = 0
    if resume:
        start = run.load(run_dir)  # the newest checkpoint, one-file or sharded (these load into any strategy)
        if start is None:
            raise CheckpointError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}; run without --resume first")
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


def _loop(cfg: RunConfig, run: Run, run_dir: Path, *, start: int, auto: bool, progress: bool) -> Summary:
    st = run.strategy
    if st.rank == 0:
        claim_run_dir(run_dir, checked=True)  # train() checked it (or found checkpoints to resume)
        (run_dir / "config.toml").write_text(dump_toml(cfg))
    else:
        run_dir.mkdir(parents=True, exist_ok=True)

    fit = Fitter(run, start_step=start, auto=auto)  # owns the loader; re-cuts a step on out-of-memory
    if st.rank == 0:
        _trim_metrics(run_dir / "metrics.jsonl", start)
    metrics = open(run_dir / "metrics.jsonl", "a") if st.rank == 0 else None
    bar = _progress(cfg.steps, start, progress and st.rank == 0)
    first_loss = math.nan
    res: StepResult | None = None
    skipped = consecutive_skips = 0
    items = 0
    timer = PhaseTimer(st.device)  # per-step breakdown for metrics.jsonl (a few perf_counter calls)
    t_start = time.perf_counter()
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            mbs = fit.micro_batches()  # blocks on the loader
            t1 = time.perf_counter()
            mbs = [to_device(mb, st.device) for mb in mbs]
            res = fit.step(step, mbs, timer=timer)  # optimizer_step, under the memory cap if any
            phases = timer.collect()  # CUDA: one sync per step to read the events
            t2 = time.perf_counter()
            _check_health(cfg, run, res, consecutive_skips + (not res.stepped), step)
            skipped += not res.stepped
            consecutive_skips = 0 if res.stepped else consecutive_skips + 1
            items += res.count
            if math.isnan(first_loss):
                first_loss = res.loss
            rate = res.count / max(t2 - t0, 1e-9)
            data_frac = (t1 - t0) / max(t2 - t0, 1e-9)
            if metrics:
                metrics.write(json.dumps({
                    "step": step + 1, "loss": res.loss, "count": res.count, "stepped": res.stepped,
                    "loss_scale": res.loss_scale, "grad_norm": res.grad_norm, "step_s": t2 - t0,
                    "data_wait_s": t1 - t0, "data_wait_frac": data_frac, f"{run.task.unit}_per_s": rate,
                    **{f"{k}_s": v for k, v in phases.items()},  # forward, backward[_sync], optimizer
                }) + "\n")
                metrics.flush()
            bar.set_postfix_str(f"loss={res.loss:.4f} {run.task.unit}/s={rate:,.0f} data={data_frac:.0%} "
                                f"scale={res.loss_scale:g}", refresh=False)
            bar.update(1)
            done = step + 1
            if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.steps:
                run.save(done)
    finally:
        fit.close()  # DataLoader workers stop here, not at the next garbage collection
        bar.close()
        if metrics:
            metrics.close()
    wall = time.perf_counter() - t_start
    return Summary(steps=cfg.steps, final_loss=res.loss if res else math.nan, first_loss=first_loss,
                   skipped_steps=skipped, items_per_s=items / max(wall, 1e-9),
                   effective_batch=cfg.micro_batch * cfg.accumulation * st.world_size, unit=run.task.unit,
                   run_dir=str(run_dir), wall_s=wall)


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


def _check_health(cfg: RunConfig, run: Run, res: StepResult, consecutive: int, step: int) -> None:
    """Stop rather than train on garbage; the last good checkpoint stays on disk."""
    if not res.stepped and not run.precision.scales_loss:
        raise TrainingStopped(
            f"step {step + 1}: loss or gradients are not finite (loss={res.loss}) with precision={cfg.precision}; "
            "stopped before corrupting the weights (lower lr, check the data, or add grad_clip)")
    if consecutive >= cfg.max_consecutive_skips:
        raise TrainingStopped(
            f"step {step + 1}: {consecutive} optimizer steps in a row overflowed in {cfg.precision}; likely cause: "
            "activations beyond fp16's range (e.g. a bf16-pretrained model run in fp16) -- use bf16-mixed")
    scale = run.precision.loss_scale
    if run.precision.scales_loss and scale < cfg.min_loss_scale:
        raise TrainingStopped(
            f"step {step + 1}: loss scale {scale:g} fell below min_loss_scale={cfg.min_loss_scale:g}; gradients "
            "overflow fp16 even unscaled -- use bf16-mixed or lower the learning rate")
