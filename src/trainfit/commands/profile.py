"""``trainfit profile``: where each step's time goes, MFU, and ordered advice.

Under torchrun (``torchrun --nproc_per_node=N -m trainfit profile --strategy ddp ...``) every
rank joins the process group and profiles; rank 0 prints the report. The work is
:func:`trainfit.front.profile.profile`; this module turns flags into its arguments and prints what it returns.
"""

from __future__ import annotations

import sys

from trainfit.commands.flags import config_from_args
from trainfit.commands.report import save_and_report
from trainfit.front.profile import profile
from trainfit.gate import check_write_target
from trainfit.outputs import check_output_file, check_run_dir, dumps_json
from trainfit.report.plots import plot_profile
from trainfit.results import ProfileReport

JSON_KEYS = ("data_wait_frac", "forward_s", "backward_s", "optimizer_s", "comm_exposed_s", "step_s", "busy_frac",
             "tokens_per_s", "mfu", "bottleneck", "advice")
"""Keys ``--json`` always prints (more may follow)."""

def run(args) -> int:
    cfg = config_from_args(args)  # validates --steps (>= 1) with the other flags
    if args.plot:  # every output path is checked before profiling, not after
        check_write_target("--plot", args.plot)  # a named pipe or device would block the write
        check_output_file("--plot", args.plot, force=args.force, suffix=".png")
    if args.report:
        check_run_dir(cfg.run_dir)
    # A config file's steps is a training length; only --steps sets the profiled steps.
    report = profile(cfg, steps=cfg.steps if args.steps is not None else None, warmup=args.warmup,
                     batch_probe=not args.no_batch_probe, precision_probe=not args.no_precision_probe,
                     overlap=args.overlap, bandwidth=args.bandwidth, trace=args.trace, force=args.force,
                     device=args.device)
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
