"""``trainfit train``: run the configured job (the embedded default when given nothing).

Under torchrun (``torchrun --nproc_per_node=N -m trainfit train ...``) each worker joins
the process group first; ``--devices N`` launches those N workers through torch's own
launcher (``torch.distributed.run``), ``--nodes M --node-rank R --master-addr A`` as node R
of an M-node job (each node waits for the others at most ``--join-timeout`` seconds, saying so
once). After an elastic restart (``--max-restarts``) the workers resume from the newest checkpoint
by themselves. The work is :func:`trainfit.front.train.train`; this module
turns flags into its arguments and prints the summary.
"""

from __future__ import annotations

import sys

import trainfit.gate as gate
from trainfit.commands.flags import config_from_args
from trainfit.commands.parsers.train import MUST
from trainfit.commands.report import run_report
from trainfit.errors import ConfigError
from trainfit.front import train as front
from trainfit.outputs import dumps_json
from trainfit.results import TrainSummary
from trainfit.strategies import launch

AUTO = front.AUTO
"""``--resume auto`` (resume when there is one); ``--resume`` alone is the parser's MUST (a checkpoint must exist)."""


LAUNCH_COUNTS = {"devices": ("devices", 1), "nodes": ("nodes", 1), "node_rank": ("node_rank", 0),
                 "master_port": ("master_port", 1), "join_timeout": ("join_timeout_s", 1),
                 "max_restarts": ("max_restarts", 0)}
"""The integer options of the launch: their field (as the front door names it) and least value."""


def read_launch_counts(args) -> None:
    """The launch options' text read by the one integer parser (``gate.parse_int``: ASCII digits, at most 19;
    argparse's ``int`` takes ``"٣"`` and ``"1_000"``), in place; refused naming the field. Upper bounds are the
    front door's (what this machine runs, :data:`trainfit.strategies.launch.MAX_NODES`)."""
    for dest, (field, minimum) in LAUNCH_COUNTS.items():
        value = getattr(args, dest)
        if isinstance(value, str):
            setattr(args, dest, gate.parse_int(field, value, minimum=minimum))


def _resume_mode(args) -> bool | str:
    """``--resume`` -> True; ``--resume auto`` -> "auto"; absent -> False. ``--resume CONFIG.toml`` (the option
    before the positional config) reads as ``CONFIG.toml --resume``."""
    mode = args.resume
    if mode not in (None, MUST, AUTO):
        if getattr(args, "config", None) is not None:
            raise ConfigError("resume", mode, "nothing (a checkpoint must exist) or auto",
                              "--resume auto resumes when there is a checkpoint and starts fresh otherwise")
        args.config, mode = mode, MUST
    return AUTO if mode == AUTO else mode == MUST


NODE_DEFAULTS = {"node_rank": 0, "master_addr": "127.0.0.1", "master_port": 29500}
"""The multi-node flags and their values when not given."""


def multi_node(args) -> dict:
    """``--node-rank``, ``--master-addr`` and ``--master-port`` as front.train's keywords; on one node they mean
    nothing (the job runs on this machine's loopback), so one given without ``--nodes`` 2 or more is refused,
    not silently ignored."""
    given = {k: getattr(args, k) for k in NODE_DEFAULTS if getattr(args, k) is not None}
    if given and args.nodes == 1:
        key, value = next(iter(given.items()))
        raise ConfigError("--" + key.replace("_", "-"), value, "a setting of a job of --nodes 2 or more",
                          "one node runs on this machine alone, so it would be ignored: drop it, or add --nodes N")
    return {**NODE_DEFAULTS, **given}


def run(args) -> int:
    read_launch_counts(args)
    mode = _resume_mode(args)
    resume = mode
    if mode == AUTO:  # resolved first: a resumed run keeps its own configuration (a fresh one is said by front)
        run_dir = args.run_dir or config_from_args(args, from_run_dir=False, nodes=args.nodes).run_dir
        resume, _ = front.resolve_resume(AUTO, run_dir)
    cfg = config_from_args(args, from_run_dir=resume, nodes=args.nodes,
                           **({"devices": args.devices} if args.devices is not None else {}))
    summary = front.train(cfg, resume=resume or mode, nodes=args.nodes, max_restarts=args.max_restarts,
                          join_timeout_s=launch.JOIN_TIMEOUT_S if args.join_timeout is None else args.join_timeout,
                          **multi_node(args))
    if summary is None:
        return 0
    if args.summary_out and launch.torchrun_env() is not None:  # a launched worker: its launcher prints it
        with open(args.summary_out, "w") as f:
            f.write(dumps_json(summary.to_dict()))
        return 0
    if args.report:
        run_report(cfg.run_dir)
    if args.json:
        print(dumps_json(summary.to_dict()))
    else:
        print(summary_line(summary), file=sys.stderr)
    return 0


def summary_line(s: TrainSummary) -> str:
    """The one line ``trainfit train`` ends with (without ``--json``)."""
    return (f"{s.steps} steps, loss {s.first_loss:.4f} -> {s.final_loss:.4f}, {s.skipped_steps} skipped, "
            f"{s.items_per_s:,.0f} {s.unit}/s, effective batch {s.effective_batch} samples"
            + (f", val loss {s.val_loss:.4f} (perplexity {s.val_perplexity:,.2f})" if s.val_loss is not None else "")
            + f"; run dir {s.run_dir}" + (f"; model {s.model_dir}" if s.model_dir else ""))
