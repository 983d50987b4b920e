"""``trainfit profile``'s flags (the command: :mod:`trainfit.commands.profile`)."""

from __future__ import annotations

from trainfit.commands.flags import add_output_group, add_run_flags, integer
from trainfit.config import MAX_STEPS

UNUSED = ("checkpoint_every", "checkpoint_minutes", "save_every", "eval_every", "eval_batches", "log")
"""Run flags a profile does not read (it writes no checkpoint, export, evaluation or log)."""


def register(sub) -> None:
    p = sub.add_parser("profile", help="step-time breakdown, throughput, MFU and ordered advice")
    groups = add_run_flags(p, leave_out=UNUSED)  # --steps here is the number of profiled steps (default 20)
    run = groups["run"]
    run.add_argument("--warmup", type=integer("warmup", minimum=0, maximum=MAX_STEPS), default=3,
                     help="steps run first and discarded (default 3)")
    run.add_argument("--no-batch-probe", action="store_true", help="skip profiling a 2x micro-batch")
    run.add_argument("--no-precision-probe", action="store_true",
                     help="skip stepping the model in the other precisions that need no more memory (by default a "
                          "few steps each, to advise when the chosen precision is slower on this device)")
    run.add_argument("--device", choices=("cpu", "cuda"), help="device for strategy=single (default: cpu)")
    dist = groups["distribution"]
    dist.add_argument("--bandwidth", help="interconnect bandwidth for scale-out predictions, e.g. 25GB/s "
                                          "(default: measured)")
    dist.add_argument("--overlap", type=float, default=0.0,
                      help="fraction of backward that hides communication in predictions (default 0)")
    out = add_output_group(p)
    out.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    out.add_argument("--report", action="store_true",
                     help="also save RUN_DIR/profile.json and write RUN_DIR/report.html")
    out.add_argument("--plot", metavar="FILE.png", help="stacked step-time bar + predicted scaling curve")
    out.add_argument("--trace", metavar="DIR", help="write a torch.profiler Chrome trace of a few extra steps")
    out.add_argument("--force", action="store_true", help="replace an existing --plot file / write into a non-empty "
                                                         "--trace directory")
