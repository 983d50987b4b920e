"""``trainfit train``: run the configured job (the embedded default when given nothing).

Under torchrun (``torchrun --nproc_per_node=N -m trainfit train ...``) each worker joins
the process group first; ``--devices N`` launches those N workers through torch's own
launcher (``torch.distributed.run``). After an elastic restart (``--max-restarts``) the
workers resume from the newest checkpoint by themselves.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

import trainfit.logs as logs

from trainfit.checkpoint import list_checkpoints
from trainfit.commands.flags import EXIT_USAGE, add_run_flags, config_from_args
from trainfit.commands.report import run_report
from trainfit.config import dump_toml
from trainfit.errors import CheckpointError, ConfigError, TrainfitError, check_int
from trainfit.export import init_weights
from trainfit.levers.autofit import StepOutOfMemory
from trainfit.levers.finetune import apply_lora, freeze
from trainfit.outputs import check_run_dir, claim_run_dir, dumps_json
from trainfit.probes.oom import explain_oom
from trainfit.strategies import launch
from trainfit.strategies import process_group as pg
from trainfit.strategies.compat import resolve_accumulation
from trainfit.strategies.dist_checkpoint import has_checkpoints, list_dcp
from trainfit.train import check_resume, refuse_checkpoints, remove_if_unstarted, train
from trainfit.run import task_of
from trainfit.vocabulary import DISTRIBUTED, parse_lora, strategy_facts


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


def _resume_mode(args) -> tuple[bool, str]:
    """(resume?, what to say): ``--resume`` -> True; ``--resume auto`` -> whether the run directory holds a
    checkpoint (a fresh start is said once the job is accepted; a directory of the user's own files is refused
    first); absent -> False. ``--resume CONFIG.toml`` (the option before the positional config) reads as
    ``CONFIG.toml --resume``."""
    mode = args.resume
    if mode not in (None, MUST, AUTO):
        if getattr(args, "config", None) is not None:
            raise ConfigError("resume", mode, "nothing (a checkpoint must exist) or auto",
                              "--resume auto resumes when there is a checkpoint and starts fresh otherwise")
        args.config, mode = mode, MUST
    if mode != AUTO:
        return mode == MUST, ""
    run_dir = args.run_dir or config_from_args(args, from_run_dir=False).run_dir
    if has_checkpoints(run_dir):
        return True, ""
    check_run_dir(Path(run_dir))  # not trainfit's: refused before anything is said
    env = launch.torchrun_env()
    return False, (f"trainfit: no checkpoint in {run_dir}; starting fresh (--resume auto)"
                   if env is None or env.rank == 0 else "")


def run(args) -> int:
    check_int("max_restarts", args.max_restarts, minimum=0)
    args.resume, fresh = _resume_mode(args)
    cfg = config_from_args(args, from_run_dir=args.resume,  # a resumed run keeps its own configuration
                           **({"devices": args.devices} if args.devices is not None else {}))
    if cfg.warmup_steps > cfg.steps:
        raise ConfigError("warmup_steps", cfg.warmup_steps, f"an integer <= steps={cfg.steps}",
                          "the learning rate would never reach --lr: shorten the warm-up or raise --steps")
    env = launch.torchrun_env()
    if env is None and cfg.devices > 1:
        if not strategy_facts(cfg.strategy).distributed:  # refuse before starting N processes that would each refuse
            raise ConfigError("strategy", cfg.strategy, DISTRIBUTED,
                              f"--devices {cfg.devices} launches {cfg.devices} processes")
        if args.max_restarts and not args.resume:  # restarted workers would resume on their own
            refuse_checkpoints(Path(cfg.run_dir))
        return _launch(cfg, args, fresh)
    if fresh:
        print(fresh, file=sys.stderr)  # held until the job is accepted (logs.accept)
    resume = args.resume
    try:
        if env is not None:
            launch.init_from_torchrun(env, timeout_s=cfg.collective_timeout_s)
            resume = resume or (env.restart_count > 0 and _has_checkpoints(cfg.run_dir))
        with pg.stop_on_peer_failure(lambda: _last_checkpoint(cfg.run_dir)):
            summary = _train(cfg, resume)
    except TrainfitError as e:
        refusal = logs.holding()  # before the first step; later (a peer lost, out of memory) each rank says why
        if env is not None and refusal and launch.relay_refusal(env.rank, env.world_size, str(e)):
            raise SystemExit(EXIT_USAGE) from None  # the launcher prints it, once
        raise
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


def _launch(cfg, args, fresh: str = "") -> int:
    """Re-run this command in ``cfg.devices`` workers; the resolved config travels as a TOML file."""
    if cfg.global_batch and cfg.micro_batch != "auto":  # the workers read accumulation already derived
        cfg = dataclasses.replace(cfg, accumulation=resolve_accumulation(
            global_batch=cfg.global_batch, micro_batch=cfg.micro_batch, accumulation=cfg.accumulation,
            world_size=cfg.devices))
    run_dir = Path(cfg.run_dir)
    created = not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir()))  # new, or empty
    _preflight(cfg, resume=args.resume)
    if not args.resume:
        claim_run_dir(run_dir)  # refuses a directory of the user's own files before starting N processes
    else:  # another job's checkpoint (other data, tokenizer, ...) is refused once, before launch.toml or a worker
        check_resume(cfg, cfg.devices)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "launch.toml").write_text(dump_toml(cfg))
    child = ["train", str(run_dir / "launch.toml"), *(["--resume"] if args.resume else []),
             *(["--json"] if args.json else [])]
    logs.accept(show=False)  # accepted: what the checks above said, each worker says again (rank 0)
    if fresh:
        print(fresh, file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="trainfit-refusals-") as refusals:
        try:
            launch.launch(cfg.devices, child, max_restarts=args.max_restarts, refusals=refusals)
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            if created:
                remove_if_unstarted(run_dir)  # a launch refused by its workers leaves nothing behind
            refused = launch.relayed_refusal(refusals)
            if refused:  # a worker refused the job (after this process's checks): its one line, once
                raise TrainfitError(refused) from None
            kept = f"; checkpoints in {run_dir / 'checkpoints'}" if has_checkpoints(run_dir) else ""
            raise TrainfitError(f"train --devices {cfg.devices}: worker rank {rank} failed with exit code "
                                f"{failure.exitcode} (its error is printed above){kept}") from None
    return 0


def _preflight(cfg, *, resume: bool) -> None:
    """What each worker would refuse, checked once here before any is started: the optional log package, the
    checkpoint to resume, the data and tokenizer (read as the task reads them), the model and its weights
    (built on the meta device: nothing allocated), --init-from, --freeze and --lora against its names."""
    logs.check_available(cfg.log)
    if resume and not has_checkpoints(cfg.run_dir):
        raise CheckpointError(f"--resume: no checkpoint in {Path(cfg.run_dir) / 'checkpoints'}; run without "
                              "--resume first, or pass --resume auto to start fresh when there is none")
    task = task_of(cfg)
    task.dataset()  # the data's content: what the workers' loaders would refuse
    try:
        with torch.device("meta"):
            model = task.build_model()
            if cfg.init_from:
                init_weights(model, cfg.init_from)  # its names and shapes; nothing is copied onto the meta device
            freeze(model, cfg.freeze)
            lora = parse_lora(cfg.lora)
            if lora is not None:
                apply_lora(model, lora)
    except TrainfitError:
        raise
    except Exception:  # noqa: BLE001 - a model that cannot be built on the meta device: the workers check it
        return
