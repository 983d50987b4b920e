"""``trainfit verify``: one step of the configured levers against the fp32 big-batch reference."""

from __future__ import annotations

import torch.distributed as dist

from trainfit.cli import add_run_flags, config_from_args
from trainfit.commands.report import save_and_report
from trainfit.outputs import check_run_dir, dumps_json
from trainfit.probes.verify import verify
from trainfit.results import VerifyReport

EXIT_FAILED = 1
"""Exit status when the check ran and failed (2 stays for bad input)."""


def register(sub) -> None:
    p = sub.add_parser("verify", help="check one step of the configured levers against the fp32 reference")
    add_run_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--report", action="store_true", help="also save RUN_DIR/verify.json and write RUN_DIR/report.html")
    p.set_defaults(func=run)


def format_report(r: VerifyReport) -> str:
    tol = r.tolerance
    lines = [
        f"verify {r.precision} / {r.strategy}: micro-batch {r.micro_batch} x accumulation "
        f"{r.accumulation} x {r.world_size} rank(s) = global batch {r.global_batch}",
        f"  gradient cosine       {r.grad_cosine:.8f}   (>= {tol.min_cosine})",
        f"  gradient rel. error   {r.grad_rel_error:.3e}   (<= {tol.max_grad_rel_error})",
        f"  gradient norm ratio   {r.grad_norm_ratio:.6g}",
        f"  update max rel. error {r.update_max_rel_error:.3e}   (<= {tol.max_update_rel_error})",
        f"  skipped steps         {r.skipped_steps}   (loss scale {r.loss_scale:g})",
        f"  fp16 underflow        {r.fp16_underflow_frac:.2%} of gradient values flush to zero in fp16 "
        "without loss scaling",
        "PASS" if r.passed else "FAIL: " + "; ".join(r.causes),
    ]
    return "\n".join(lines)


def run(args) -> int:
    cfg = config_from_args(args)
    if args.report:
        check_run_dir(cfg.run_dir)
    report = verify(cfg)
    d = report.to_dict()
    # Under torchrun every rank computes the same report; print it once.
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(dumps_json(d) if args.json else format_report(report))
        if args.report:
            save_and_report(cfg.run_dir, "verify.json", d, report=True)
    return 0 if report.passed else EXIT_FAILED
