"""``trainfit train``'s flags (the command: :mod:`trainfit.commands.train`)."""

from __future__ import annotations

import argparse

from trainfit.commands.flags import add_output_group, add_run_flags

MUST = "must"
"""``--resume`` without a value: there must be a checkpoint (``--resume auto``: resume when there is one)."""
JOIN_TIMEOUT_S = 300.0
"""Mirror of ``trainfit.strategies.launch.JOIN_TIMEOUT_S`` (that module imports torch): ``--join-timeout``'s
default, as its help says it."""


def register(sub) -> None:
    p = sub.add_parser("train", help="train (the embedded default when given nothing)")
    groups = add_run_flags(p)
    groups["run"].add_argument(
        "--resume", nargs="?", const=MUST, default=None, metavar="auto",
        help="continue from the newest checkpoint in --run-dir (it must hold one); --resume auto: continue if it "
             "holds one, else start fresh")
    _add_distribution(groups["distribution"])
    out = add_output_group(p)
    out.add_argument("--json", action="store_true", help="print one JSON summary object on stdout")
    out.add_argument("--report", action="store_true", help="also write RUN_DIR/report.html (trainfit report)")
    out.add_argument("--summary-out", help=argparse.SUPPRESS)  # a launched worker's summary, for its launcher


def _add_distribution(dist) -> None:
    """The launch: devices on this node, the nodes of the job and how they meet, restarts."""
    dist.add_argument("--devices", "--nproc", dest="devices",
                      help="launch N processes (one per device) on this node with torch.distributed.run "
                           "(at most what this machine runs: 4 per CPU core, DataLoader workers included)")
    dist.add_argument("--nodes", default=1,
                      help="nodes of the job (default 1); run the same command on each, with --node-rank")
    dist.add_argument("--node-rank", help="with --nodes: this node's rank (0 hosts rank 0)")
    dist.add_argument("--master-addr", help="with --nodes: the address of node 0, reachable from every node "
                                            "(default 127.0.0.1)")
    dist.add_argument("--master-port", help="with --nodes: a free port on node 0 (default 29500)")
    dist.add_argument("--join-timeout", metavar="SECONDS",
                      help=f"with --nodes: how long this node waits for the others (default {JOIN_TIMEOUT_S:g}), "
                           "then stops")
    dist.add_argument("--max-restarts", default=0,
                      help="with --devices: restart all workers up to N times after a failure (they resume)")
