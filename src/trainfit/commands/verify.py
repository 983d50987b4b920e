"""``trainfit verify``: one step of the configured levers against the fp32 big-batch reference."""

from __future__ import annotations

import torch.distributed as dist

from trainfit.cli import add_run_flags, config_from_args
from trainfit.errors import ConfigError
from trainfit.commands.report import save_and_report
from trainfit.integrations.frameworks import FRAMEWORKS, LOSSES, FrameworkVerifyReport, verify_framework
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
    p.add_argument("--framework", choices=FRAMEWORKS, default=None,
                   help="run THAT tool's accumulation (its own optimizer step) on micro-batches with uneven loss-token "
                        "counts and compare its gradient with the fp32 big-batch reference")
    p.add_argument("--framework-loss", choices=LOSSES, default="default",
                   help="with --framework accelerate|lightning: the loop's loss, the micro-batch mean (default) or "
                        "token-weighted (sum / the window's token count, the fix)")
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


def format_framework(r: FrameworkVerifyReport) -> str:
    tol = r.tolerance
    lines = [
        f"verify --framework {r.framework} ({r.loss} loss): {r.model}, micro-batch {r.micro_batch} x accumulation "
        f"{r.accumulation}, loss tokens per micro-batch {'/'.join(map(str, r.loss_tokens))}",
        f"  what it did           {r.path}",
        f"  gradient cosine       {r.grad_cosine:.8f}   (>= {tol.min_cosine})",
        f"  gradient rel. error   {r.grad_rel_error:.3e}   (<= {tol.max_grad_rel_error})",
        f"  gradient norm ratio   {r.grad_norm_ratio:.6g}",
        f"  vs mean of means      {r.mean_of_means_rel_error:.3e}",
        "PASS" if r.passed else "FAIL: " + "; ".join(r.causes) + f"\n  fix: {r.fix}",
    ]
    return "\n".join(lines)


def run_framework(args) -> int:
    if args.report:
        raise ConfigError("report", True, "no --report with --framework", "print it, or save the --json output")
    cfg = config_from_args(args)
    report = verify_framework(cfg, framework=args.framework, loss=args.framework_loss)
    print(dumps_json(report.to_dict()) if args.json else format_framework(report))
    return 0 if report.passed else EXIT_FAILED


def run(args) -> int:
    if args.framework is not None:
        return run_framework(args)
    if args.framework_loss != "default":
        raise ConfigError("framework_loss", args.framework_loss, "default without --framework",
                          "add --framework accelerate or --framework lightning")
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
