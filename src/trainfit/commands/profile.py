"""``trainfit profile``: where each step's time goes, MFU, and ordered advice.

Under torchrun (``torchrun --nproc_per_node=N -m trainfit profile --strategy ddp ...``) every
rank joins the process group and profiles; rank 0 prints the report.
"""

from __future__ import annotations

import math
import sys

import torch

from trainfit.commands.flags import add_run_flags, config_from_args
from trainfit.commands.report import save_and_report
from trainfit.errors import ConfigError, check_int
from trainfit.outputs import check_output_dir, check_output_file, check_run_dir, dumps_json
from trainfit.probes.profile import ProfileOptions, profile
from trainfit.report.plots import plot_profile
from trainfit.results import ProfileReport
from trainfit.run import build_run
from trainfit.strategies import launch
from trainfit.strategies import process_group as pg
from trainfit.strategies.single import Single
from trainfit.units import parse_bytes
from trainfit.vocabulary import StrategyName, strategy_facts

DEFAULT_STEPS = 20
JSON_KEYS = ("data_wait_frac", "forward_s", "backward_s", "optimizer_s", "comm_exposed_s", "step_s", "busy_frac",
             "tokens_per_s", "mfu", "bottleneck", "advice")
"""Keys ``--json`` always prints (more may follow)."""


def register(sub) -> None:
    p = sub.add_parser("profile", help="step-time breakdown, throughput, MFU and ordered advice")
    add_run_flags(p)  # --steps here is the number of profiled steps (default 20)
    p.add_argument("--warmup", type=int, default=3, help="steps run first and discarded (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--report", action="store_true", help="also save RUN_DIR/profile.json and write RUN_DIR/report.html")
    p.add_argument("--plot", metavar="FILE.png", help="stacked step-time bar + predicted scaling curve")
    p.add_argument("--trace", metavar="DIR", help="write a torch.profiler Chrome trace of a few extra steps")
    p.add_argument("--bandwidth", help="interconnect bandwidth for scale-out predictions, e.g. 25GB/s "
                                       "(default: measured)")
    p.add_argument("--overlap", type=float, default=0.0,
                   help="fraction of backward that hides communication in predictions (default 0)")
    p.add_argument("--no-batch-probe", action="store_true", help="skip profiling a 2x micro-batch")
    p.add_argument("--no-precision-probe", action="store_true",
                   help="skip stepping the model in the other precisions that need no more memory (by default a "
                        "few steps each, to advise when the chosen precision is slower on this device)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="device for strategy=single (default: cpu)")
    p.add_argument("--force", action="store_true", help="replace an existing --plot file / write into a non-empty "
                                                       "--trace directory")
    p.set_defaults(func=run)


def parse_bandwidth(text: str) -> float:
    t = str(text).strip()
    if not t.lower().endswith("/s"):
        raise ConfigError("--bandwidth", text, "bytes per second such as 25GB/s or 400MiB/s")
    return float(parse_bytes("--bandwidth", t[:-2]))


def run(args) -> int:
    cfg = config_from_args(args)  # validates --steps (>= 1) with the other flags
    check_int("warmup", args.warmup, minimum=0)
    if not (isinstance(args.overlap, float) and math.isfinite(args.overlap) and 0.0 <= args.overlap <= 1.0):
        raise ConfigError("overlap", args.overlap, "a number in [0, 1]")
    if args.plot:  # every output path is checked before profiling, not after
        check_output_file("--plot", args.plot, force=args.force, suffix=".png")
    if args.trace:
        check_output_dir("--trace", args.trace, force=args.force)
    if args.report:
        check_run_dir(cfg.run_dir)
    # A config file's steps is a training length; only --steps sets the profiled steps.
    options = ProfileOptions(steps=cfg.steps if args.steps is not None else DEFAULT_STEPS, warmup=args.warmup,
                             batch_probe=not args.no_batch_probe, overlap=args.overlap, trace_dir=args.trace,
                             precision_probe=not args.no_precision_probe,
                             bandwidth_bytes_per_s=parse_bandwidth(args.bandwidth) if args.bandwidth else None)
    launch.join_if_launched(timeout_s=cfg.collective_timeout_s)  # torchrun: every rank profiles
    try:
        report = _profile(cfg, args, options)
    finally:
        pg.destroy()
    if report.rank != 0:  # rank 0 reports
        return 0
    out = report.to_dict()
    if args.plot:
        out["plot"] = plot_profile(report, args.plot)  # read back into ProfileReport.extra
    if args.report:
        save_and_report(cfg.run_dir, "profile.json", out, report=True)
    if args.json:
        print(dumps_json(out))
    else:
        print(format_report(report), file=sys.stderr)
    return 0


def _profile(cfg, args, options) -> ProfileReport:
    strategy = None
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device", "cuda", "cpu (no CUDA device is visible)")
        if strategy_facts(cfg.strategy).distributed:
            raise ConfigError("--device", "cuda", f"only with strategy={StrategyName.SINGLE} (distributed runs pick "
                              "their device)")
        strategy = Single("cuda")
    return profile(build_run(cfg, strategy=strategy), options)


def format_report(r: ProfileReport) -> str:
    rows = [f"{'part':<16}{'median ms':>11}{'p25-p75 ms':>16}{'share':>8}"]
    for key in ("data_wait_s", "h2d_s", "forward_s", "backward_s", "optimizer_s", "comm_exposed_s", "rest_s",
                "step_s"):
        s = r.parts[key]
        rows.append(f"{key[:-2]:<16}{s['median'] * 1e3:>11.2f}{s['p25'] * 1e3:>8.2f}-{s['p75'] * 1e3:<7.2f}"
                    f"{r.fractions[key]:>8.0%}")
    rate = r.tokens_per_s if r.tokens_per_s is not None else r.samples_per_s
    mfu = "null" if r.mfu is None else f"{r.mfu:.2%} (HFU {r.hfu:.2%})"
    rows.append(f"{rate:,.0f} {r.unit}/s per device; busy {r.busy_frac:.0%}; MFU {mfu} vs "
                f"{r.peak_source}")
    rows.append(f"bottleneck: {r.bottleneck}")
    rows += [f"  {i}. [{a.kind}] {a.text}" for i, a in enumerate(r.advice, 1)]
    return "\n".join(rows)
