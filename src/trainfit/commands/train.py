"""``trainfit train``: run the configured job (the embedded default when given nothing)."""

from __future__ import annotations

import json
import sys

from trainfit.cli import add_run_flags, config_from_args


def register(sub) -> None:
    p = sub.add_parser("train", help="train (the embedded default when given nothing)")
    add_run_flags(p)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    p.add_argument("--json", action="store_true", help="print one JSON summary object on stdout")
    p.set_defaults(func=run)


def run(args) -> int:
    from trainfit.train import train

    cfg = config_from_args(args)
    summary = train(cfg, resume=args.resume, progress=True).to_dict()
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['steps']} steps, loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
              f"{summary['skipped_steps']} skipped, {summary['tokens_per_s']:,.0f} {summary['unit']}/s, "
              f"effective batch {summary['effective_batch']} samples; run dir {summary['run_dir']}", file=sys.stderr)
    return 0
