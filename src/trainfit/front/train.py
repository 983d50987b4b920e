"""``trainfit train`` as a library call: run the configured job and return its summary.

    from trainfit.front.train import train
    s = train(model="gpt-tiny", steps=20, run_dir="runs/try")
    s.final_loss, s.tokens_per_s

With ``devices=N`` (per node) and no torchrun around it, N worker processes are launched through torch's own
launcher (``torch.distributed.run``); ``nodes=M`` makes them one node of an M-node job (``node_rank``,
``master_addr``, ``master_port``: run the same call on each node). Under torchrun each worker joins the process
group and trains. The summary comes back on global rank 0 (and the launcher of its node); None elsewhere.

Before anything is created (no run directory, no process), a launch is bounded: the processes this machine would
start (``devices`` x (1 + ``loader_workers``)) by :func:`trainfit.gate.max_processes`, ``nodes`` by
:data:`~trainfit.strategies.launch.MAX_NODES`; node 0's address must resolve (once, with a timeout). A node then
waits for its peers at most ``join_timeout_s`` (said once) and stops in one line; launch settings that would change
nothing (an address on one node, restarts of a job that launches nothing) are refused, not ignored.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

import trainfit.logs as logs
import trainfit.gate as gate
from trainfit.checkpoint import list_checkpoints
from trainfit.config import DistributionSection, RunConfig, ScheduleSection, dump_toml
from trainfit.errors import CheckpointError, ConfigError, TrainfitError, check_int, check_number
from trainfit.export import init_weights
from trainfit.front.request import config_of
from trainfit.levers.autofit import StepOutOfMemory
from trainfit.levers.finetune import apply_lora, freeze
from trainfit.outputs import check_path_text, check_run_dir, claim_run_dir
from trainfit.probes.oom import explain_oom
from trainfit.progress import info
from trainfit.results import TrainSummary
from trainfit.run import task_of
from trainfit.strategies import launch
from trainfit.strategies import process_group as pg
from trainfit.strategies.compat import resolve_accumulation
from trainfit.strategies.dist_checkpoint import has_checkpoints, list_dcp
from trainfit.train import check_resume, refuse_checkpoints, remove_if_unstarted
from trainfit.train import train as train_loop
from trainfit.vocabulary import distributed_strategies, parse_lora, strategy_facts

AUTO = "auto"
"""``resume="auto"``: resume when the run directory holds a checkpoint, else start fresh."""
EXIT_REFUSED = 2
"""Exit status of a worker whose refusal the launcher prints (the CLI's usage status)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Nodes:
    """Where this launcher's workers sit in a multi-node job (``nodes=1``: this machine alone)."""

    nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    join_timeout_s: float = launch.JOIN_TIMEOUT_S
    """How long this node waits for its peers (several nodes), then stops in one line."""

    def __post_init__(self) -> None:
        check_int("nodes", self.nodes, minimum=1, maximum=launch.MAX_NODES,
                  fix="the nodes of one job; above every machine built so far")
        check_int("node_rank", self.node_rank, minimum=0, maximum=self.nodes - 1)
        check_int("master_port", self.master_port, minimum=1, maximum=65535)
        if not isinstance(self.master_addr, str) or not self.master_addr.strip():
            raise ConfigError("master_addr", self.master_addr, "a host name or address of node 0")
        check_path_text("master_addr", self.master_addr)
        check_number("join_timeout_s", self.join_timeout_s, minimum=0.0)
        if self.join_timeout_s > launch.MAX_JOIN_TIMEOUT_S:
            raise ConfigError("join_timeout_s", self.join_timeout_s,
                              f"a number of seconds in (0, {launch.MAX_JOIN_TIMEOUT_S:g}]", "at most a day")
        if self.nodes == 1:
            self._refuse_unused()

    def _refuse_unused(self) -> None:
        """On one node the job rendezvouses on a free loopback port: a node address, port or join timeout other
        than the default would change nothing, so it is refused rather than ignored."""
        defaults = Nodes(nodes=2)
        for name in ("master_addr", "master_port", "join_timeout_s"):
            if getattr(self, name) != getattr(defaults, name):
                raise ConfigError(name, getattr(self, name), "a setting of a job of nodes=2 or more",
                                  "one node runs on this machine alone (a free loopback port), so it would be "
                                  "ignored: drop it, or give nodes")

    @property
    def default(self) -> bool:
        """Whether every field is its default (what a process launched by torchrun must be given)."""
        return self == Nodes()


def train(config: RunConfig | None = None, *, resume: bool | str = False, nodes: int = 1, node_rank: int = 0,
          master_addr: str = "127.0.0.1", master_port: int = 29500, join_timeout_s: float = launch.JOIN_TIMEOUT_S,
          max_restarts: int = 0, progress: bool = True, **fields: Any) -> TrainSummary | None:
    """Train ``config`` (or the RunConfig ``fields``, e.g. ``devices=2``) to its ``steps``.

    Args:
        resume: True: from the newest checkpoint in ``run_dir`` (there must be one); ``"auto"``: when there is one.
        nodes, node_rank, master_addr, master_port: a multi-node job (``devices`` per node).
        join_timeout_s: with ``nodes`` > 1, how long this node waits for its peers (default 300 s), then stops.
        max_restarts: with launched workers, restart them all up to N times after a failure (they resume).
    Returns:
        The summary on global rank 0 (in the launcher of its node too); None on the other ranks and nodes.
    Raises:
        ConfigError: a bad field or combination (one line, as ``trainfit train`` says it), before any work.
    """
    cfg = config_of(config, fields)
    where = Nodes(nodes=nodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port,
                  join_timeout_s=join_timeout_s)
    check_int("max_restarts", max_restarts, minimum=0)
    env = launch.torchrun_env()
    launching = env is None and cfg.devices * where.nodes > 1
    check_launch(where, devices=cfg.devices, loader_workers=cfg.loader_workers, launching=launching,
                 under_torchrun=env is not None, max_restarts=max_restarts)
    resume, fresh = resolve_resume(resume, cfg.run_dir)
    check_job(cfg.section("schedule"))
    if launching:
        if not strategy_facts(cfg.strategy).distributed:  # refuse before starting N processes that would each refuse
            raise ConfigError("strategy", cfg.strategy, distributed_strategies(),
                              f"--devices {cfg.devices} x --nodes {where.nodes} launches "
                              f"{cfg.devices * where.nodes} processes" if where.nodes > 1 else
                              f"--devices {cfg.devices} launches {cfg.devices} processes")
        if max_restarts and not resume:  # restarted workers would resume on their own
            refuse_checkpoints(Path(cfg.run_dir))
        return launch_workers(cfg, where, resume=resume, max_restarts=max_restarts, fresh=fresh)
    if fresh:
        info("train", fresh)  # held until the job is accepted (logs.accept)
    return train_here(cfg, resume=resume, progress=progress)


def check_launch(where: Nodes, *, devices: int, loader_workers: int, launching: bool, under_torchrun: bool,
                 max_restarts: int) -> None:
    """What a launch may ask of this machine, refused before anything is created: the processes it starts here
    (each worker and its DataLoader workers) within :func:`trainfit.gate.max_processes`; node 0's address
    resolved once, with a timeout; launch settings that would change nothing (torchrun placed this process, or
    nothing is launched) refused, not ignored."""
    if under_torchrun and not where.default:
        field = next(f.name for f in dataclasses.fields(Nodes) if getattr(where, f.name) != getattr(Nodes(), f.name))
        raise ConfigError(field, getattr(where, field), "trainfit's own launch only (without torchrun)",
                          "torchrun started this process: its --nnodes, --node-rank and --master-addr place it")
    if max_restarts and not launching:
        raise ConfigError("max_restarts", max_restarts, "0 unless trainfit launches workers (devices or nodes > 1)",
                          "torchrun's own --max-restarts restarts its workers" if under_torchrun else
                          "a single process is not restarted: drop it, or give --devices N")
    if not launching:
        return
    gate.check_process_count("devices", devices)
    limit, local = gate.max_processes(), devices * (1 + loader_workers)
    if local > limit:
        raise ConfigError("loader_workers", loader_workers,
                          f"at most {limit // devices - 1} with devices={devices} on this machine",
                          f"{devices} workers each starting {loader_workers} loader processes make {local} "
                          f"processes, over the {limit} this machine runs")
    if where.nodes > 1:
        launch.resolve_host("master_addr", where.master_addr, port=where.master_port)


def check_job(schedule: ScheduleSection) -> None:
    """What the command refuses of a configuration beyond RunConfig's own checks."""
    if schedule.warmup_steps > schedule.steps:
        raise ConfigError("warmup_steps", schedule.warmup_steps, f"an integer <= steps={schedule.steps}",
                          "the learning rate would never reach --lr: shorten the warm-up or raise --steps")


def resolve_resume(mode: bool | str | None, run_dir: str) -> tuple[bool, str]:
    """(resume?, what to say once the job is accepted): True/False as given; ``"auto"``: whether ``run_dir``
    holds a checkpoint (a directory of the user's own files is refused first)."""
    if mode in (None, False, True):
        return bool(mode), ""
    if mode != AUTO:
        raise ConfigError("resume", mode, "True, False or auto",
                          "resume=auto resumes when there is a checkpoint and starts fresh otherwise")
    if has_checkpoints(run_dir):
        return True, ""
    check_run_dir(Path(run_dir))  # not trainfit's: refused before anything is said
    env = launch.torchrun_env()
    return False, (f"trainfit: no checkpoint in {run_dir}; starting fresh (--resume auto)"
                   if env is None or env.rank == 0 else "")


def train_here(cfg: RunConfig, *, resume: bool, progress: bool = True) -> TrainSummary | None:
    """Train in this process (joining torchrun's process group when launched by it); the summary on rank 0."""
    env = launch.torchrun_env()
    try:
        if env is not None:
            launch.init_from_torchrun(env, timeout_s=cfg.collective_timeout_s)
            resume = resume or (env.restart_count > 0 and has_checkpoints(cfg.run_dir))
        with pg.stop_on_peer_failure(lambda: _last_checkpoint(cfg.run_dir)):
            return _train(cfg, resume, progress)
    except TrainfitError as e:
        refusal = logs.holding()  # before the first step; later (a peer lost, out of memory) each rank says why
        if env is not None and refusal and launch.relay_refusal(env.rank, env.world_size, str(e)):
            raise SystemExit(EXIT_REFUSED) from None  # the launcher prints it, once
        raise
    finally:
        pg.destroy()


def _train(cfg: RunConfig, resume: bool, progress: bool) -> TrainSummary | None:
    """Train; the summary on rank 0, None on the other ranks. A step that runs out of memory (auto-fit off) is
    explained by rank 0 (``probes.oom``: RUN_DIR/oom.json and one paragraph)."""
    try:
        summary = train_loop(cfg, resume=resume, progress=progress)
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


def _last_checkpoint(run_dir: str) -> str | None:
    found = sorted([*list_dcp(run_dir), *list_checkpoints(run_dir)], key=lambda p: p.name)
    return str(found[-1]) if found else None


SUMMARY_FILE = "summary.json"
"""Where global rank 0 of launched workers leaves its summary for the launcher (in a temporary directory)."""


def launch_workers(cfg: RunConfig, where: Nodes, *, resume: bool, max_restarts: int = 0,
                   fresh: str = "") -> TrainSummary | None:
    """Run ``trainfit train`` in ``cfg.devices`` workers on this node; the resolved config travels as TOML."""
    world = cfg.devices * where.nodes
    if cfg.global_batch and cfg.micro_batch != "auto":  # the workers read accumulation already derived
        cfg = dataclasses.replace(cfg, accumulation=resolve_accumulation(
            global_batch=cfg.global_batch, micro_batch=cfg.micro_batch, accumulation=cfg.accumulation,
            world_size=world))
    run_dir = Path(cfg.run_dir)
    first = where.node_rank == 0  # node 0 holds global rank 0: it owns the run directory's checks
    created = first and (not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir())))
    _preflight(cfg, resume=resume)
    if first and not resume:
        claim_run_dir(run_dir)  # refuses a directory of the user's own files before starting N processes
    elif first:  # another job's checkpoint (other data, tokenizer, ...) is refused once, before launch.toml
        check_resume(cfg, world)
    logs.accept(show=False)  # accepted: what the checks above said, each worker says again (rank 0)
    if fresh:
        info("train", fresh)
    with tempfile.TemporaryDirectory(prefix="trainfit-launch-") as tmp:
        # Node 0 keeps the job in RUN_DIR/launch.toml; another node's copy stays outside the run directory,
        # which node 0 owns (and may share with it).
        job = run_dir / "launch.toml" if first else Path(tmp, "launch.toml")
        job.parent.mkdir(parents=True, exist_ok=True)
        job.write_text(dump_toml(cfg))
        summary = Path(tmp, SUMMARY_FILE)
        child = ["train", str(job), *(["--resume"] if resume else []), "--summary-out", str(summary)]
        refusals = Path(tmp, "refusals")
        refusals.mkdir()
        try:
            launch.launch(cfg.devices, child, max_restarts=max_restarts, refusals=refusals, nnodes=where.nodes,
                          node_rank=where.node_rank, master_addr=where.master_addr, master_port=where.master_port,
                          join_timeout_s=where.join_timeout_s)
        except ChildFailedError as e:
            _failed(e, cfg.section("distribution"), run_dir, created=created, refusals=refusals)
        except launch.PeersMissing:
            if created:
                remove_if_unstarted(run_dir)  # the peers never came: nothing was trained, nothing is left
            raise
        return TrainSummary.from_dict(json.loads(summary.read_text())) if summary.is_file() else None


def _failed(e: ChildFailedError, dist: DistributionSection, run_dir: Path, *, created: bool, refusals: Path) -> None:
    rank, failure = e.get_first_failure()
    if created:
        remove_if_unstarted(run_dir)  # a launch refused by its workers leaves nothing behind
    refused = launch.relayed_refusal(refusals)
    if refused:  # a worker refused the job (after this process's checks): its one line, once
        raise TrainfitError(refused) from None
    kept = f"; checkpoints in {run_dir / 'checkpoints'}" if has_checkpoints(run_dir) else ""
    raise TrainfitError(f"train --devices {dist.devices}: worker rank {rank} failed with exit code "
                        f"{failure.exitcode} (its error is printed above){kept}") from None


def _preflight(cfg: RunConfig, *, resume: bool) -> None:
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
