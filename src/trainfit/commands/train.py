"""``trainfit train``: run the configured job (the embedded default when given nothing).

Under torchrun (``torchrun --nproc_per_node=N -m trainfit train ...``) each worker joins
the process group first; ``--devices N`` launches those N workers through torch's own
launcher (``torch.distributed.run``). After an elastic restart (``--max-restarts``) the
workers resume from the newest checkpoint by themselves.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from trainfit.checkpoint import list_checkpoints
from trainfit.cli import add_run_flags, config_from_args
from trainfit.commands.report import run_report
from trainfit.config import dump_toml
from trainfit.errors import ConfigError, TrainfitError, check_int
from trainfit.levers.autofit import StepOutOfMemory
from trainfit.outputs import claim_run_dir, dumps_json
from trainfit.probes.oom import explain_oom
from trainfit.strategies import launch
from trainfit.strategies import process_group as pg
from trainfit.strategies.compat import resolve_accumulation
from trainfit.strategies.dist_checkpoint import has_checkpoints, list_dcp
from trainfit.train import refuse_checkpoints, remove_if_unstarted, train
from trainfit.vocabulary import DISTRIBUTED, strategy_facts


MUST, AUTO = "must", "auto"
"""``--resume`` (there must be a checkpoint) and ``--resume auto`` (resume when there is one)."""


def register(sub) -> None:
    p = sub.add_parser("train", help="train (the embedded default when given nothing)")
    add_run_flags(p)
    p.add_argument("--resume", nargs="?", const=MUST, default=None, metavar="auto",
                   help="continue from the newest checkpoint in --run-dir (it must hold one); --resume auto: "
                        "continue if it holds one, else start fresh")
    p.add_argument("--json", action="store_true", help="print one JSON summary object on stdout")
    p.add_argument("--report", action="store_true", help="also write RUN_DIR/report.html (trainfit report)")
    p.add_argument("--devices", "--nproc", dest="devices", type=int,
                   help="launch N processes (one per device) on this machine with torch.distributed.run")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="with --devices: restart all workers up to N times after a failure (they resume)")
    p.set_defaults(func=run)


def _resume_mode(args) -> bool:
    """``--resume`` -> True; ``--resume auto`` -> whether the run directory holds a checkpoint (a fresh start
    is said on stderr, once); absent -> False. ``--resume CONFIG.toml`` (the option before the positional
    config) reads as ``CONFIG.toml --resume``."""
    mode = args.resume
    if mode not in (None, MUST, AUTO):
        if getattr(args, "config", None) is not None:
            raise ConfigError("resume", mode, "nothing (a checkpoint must exist) or auto",
                              "--resume auto resumes when there is a checkpoint and starts fresh otherwise")
        args.config, mode = mode, MUST
    if mode != AUTO:
        return mode == MUST
    run_dir = args.run_dir or config_from_args(args, from_run_dir=False).run_dir
    if has_checkpoints(run_dir):
        return True
    env = launch.torchrun_env()
    if env is None or env.rank == 0:
        print(f"trainfit: no checkpoint in {run_dir}; starting fresh (--resume auto)", file=sys.stderr)
    return False


def run(args) -> int:
    check_int("max_restarts", args.max_restarts, minimum=0)
    args.resume = _resume_mode(args)
    cfg = config_from_args(args, from_run_dir=args.resume,  # a resumed run keeps its own configuration
                           **({"devices": args.devices} if args.devices is not None else {}))
    env = launch.torchrun_env()
    if env is None and cfg.devices > 1:
        if not strategy_facts(cfg.strategy).distributed:  # refuse before starting N processes that would each refuse
            raise ConfigError("strategy", cfg.strategy, DISTRIBUTED,
                              f"--devices {cfg.devices} launches {cfg.devices} processes")
        if args.max_restarts and not args.resume:  # restarted workers would resume on their own
            refuse_checkpoints(Path(cfg.run_dir))
        return _launch(cfg, args)
    resume = args.resume
    if env is not None:
        launch.init_from_torchrun(env, timeout_s=cfg.collective_timeout_s)
        resume = resume or (env.restart_count > 0 and _has_checkpoints(cfg.run_dir))
    try:
        with pg.stop_on_peer_failure(lambda: _last_checkpoint(cfg.run_dir)):
            summary = _train(cfg, resume)
    finally:
        pg.destroy()
    if summary is None:
        return 0
    if args.report:
        run_report(cfg.run_dir)
    if args.json:
        print(dumps_json(summary))
    else:
        print(f"{summary['steps']} steps, loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
              f"{summary['skipped_steps']} skipped, {summary['items_per_s']:,.0f} {summary['unit']}/s, "
              f"effective batch {summary['effective_batch']} samples"
              + (f", val loss {summary['val_loss']:.4f} (perplexity {summary['val_perplexity']:,.2f})"
                 if summary.get("val_loss") is not None else "")
              + f"; run dir {summary['run_dir']}"
              + (f"; model {summary['model_dir']}" if summary.get("model_dir") else ""), file=sys.stderr)
    return 0


def _train(cfg, resume: bool) -> dict | None:
    """Train; the summary on rank 0, None on the other ranks (only rank 0 reports). A step that runs out of
    memory (auto-fit off) is explained by rank 0 (``probes.oom``: RUN_DIR/oom.json and one paragraph, exit 2)."""
    try:
        summary = train(cfg, resume=resume, progress=True).to_dict()
    except StepOutOfMemory as e:
        failed = {"micro_batch": e.micro_batch, "accumulation": e.accumulation, "step": e.step}
        if pg.current() is not None and pg.current().rank != 0:
            raise
    else:
        failed = None
    world = pg.current()
    if failed is not None:  # out of the except block: the failed step's frames (and its memory) are freed
        raise TrainfitError(explain_oom(cfg, devices=world.world_size if world else 1, **failed))
    return summary if world is None or world.rank == 0 else None


def _has_checkpoints(run_dir: str) -> bool:
    return has_checkpoints(run_dir)


def _last_checkpoint(run_dir: str) -> str | None:
    found = sorted([*list_dcp(run_dir), *list_checkpoints(run_dir)], key=lambda p: p.name)
    return str(found[-1]) if found else None


def _launch(cfg, args) -> int:
    """Re-run this command in ``cfg.devices`` workers; the resolved config travels as a TOML file."""
    if cfg.global_batch and cfg.micro_batch != "auto":  # the workers read accumulation already derived
        cfg = dataclasses.replace(cfg, accumulation=resolve_accumulation(
            global_batch=cfg.global_batch, micro_batch=cfg.micro_batch, accumulation=cfg.accumulation,
            world_size=cfg.devices))
    run_dir = Path(cfg.run_dir)
    created = not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir()))  # new, or empty
    if not args.resume:
        claim_run_dir(run_dir)  # refuses a directory of the user's own files before starting N processes
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "launch.toml").write_text(dump_toml(cfg))
    child = ["train", str(run_dir / "launch.toml"), *(["--resume"] if args.resume else []),
             *(["--json"] if args.json else [])]
    try:
        launch.launch(cfg.devices, child, max_restarts=args.max_restarts)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if created:
            remove_if_unstarted(run_dir)  # a launch refused by its workers leaves nothing behind
        raise TrainfitError(f"train --devices {cfg.devices}: worker rank {rank} failed with exit code "
                            f"{failure.exitcode} (its error is printed above); checkpoints in {run_dir / 'checkpoints'}"
                            ) from None
    return 0
