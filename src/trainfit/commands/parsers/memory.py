"""``trainfit memory``'s flags (the command: :mod:`trainfit.commands.memory`)."""

from __future__ import annotations

from trainfit.commands.flags import add_output_group, add_run_flags, integer
from trainfit.config import MAX_COUNTS
from trainfit.meters.devices import DEVICES

UNUSED = ("steps", "lr", "schedule", "warmup_steps", "min_lr", "weight_decay", "checkpoint_every",
          "checkpoint_minutes", "save_every", "eval_every", "eval_batches", "log")
"""Run flags one step's memory does not depend on (not listed by ``--help``; a TOML file may still carry them)."""


def register(sub) -> None:
    p = sub.add_parser("memory", help="what fills memory in one step: parameters, gradients, optimizer, activations")
    groups = add_run_flags(p, leave_out=UNUSED)
    groups["levers"].add_argument("--batch", type=integer("batch", minimum=1, maximum=MAX_COUNTS["micro_batch"]),
                                  help="samples per micro-batch (same as --micro-batch)")
    how = groups["run"].add_mutually_exclusive_group()
    how.add_argument("--measure", dest="method", action="store_const", const="measure",
                     help="run two real steps and measure the second (default)")
    how.add_argument("--estimate", dest="method", action="store_const", const="estimate",
                     help="trace the step under fake tensors: nothing is allocated (for models too big here)")
    groups["run"].add_argument("--from", dest="from_file", metavar="FILE",
                               help="read the job from a transformers TrainingArguments JSON, an accelerate config "
                                    "YAML or Lightning Trainer arguments (flags override it)")
    _add_distribution(groups["distribution"])
    groups["levers"].add_argument("--compare-checkpointing", metavar="SPECS",
                   help="one row per checkpointing policy, side by side: saved (activation) bytes, peak and "
                        "recompute FLOPs, e.g. none,selective,full,budget:0.5,every:2")
    out = add_output_group(p)
    out.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    out.add_argument("--plot", metavar="FILE.png", help="write a stacked bar per phase")
    out.add_argument("--report", action="store_true",
                     help="also save RUN_DIR/memory.json and write RUN_DIR/report.html")
    out.add_argument("--force", action="store_true", help="replace an existing --plot file")
    p.set_defaults(method="measure")


def _add_distribution(dist) -> None:
    """--devices, --nodes, --device and --budget: where an estimate spreads and what it must fit."""
    dist.add_argument("--devices", "--world", dest="devices", default=None,
                      type=integer("devices"),  # its range: front.memory's check, said as the front door says it
                      help="with --estimate: devices (ranks) per node to spread --strategy over (per-rank bytes, no "
                           "processes launched)")
    dist.add_argument("--nodes", type=integer("nodes"), default=None,
                      help="with --estimate: nodes of --devices each (default 1)")
    dist.add_argument("--device", dest="target", default="cpu",
                      help="with --estimate: the device whose kernels the trace follows (attention, dropout, "
                           "autocast, optimizer as they run there): " + ", ".join(DEVICES) +
                           " (default cpu: this machine's)")
    dist.add_argument("--budget", help="device memory to fit, e.g. 24GiB: prints the largest micro-batch that fits")
