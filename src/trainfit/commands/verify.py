"""``trainfit verify``: one step of the configured levers against the fp32 big-batch reference."""

from __future__ import annotations

import sys

import torch.distributed as dist

from trainfit.commands.flags import add_run_flags, config_from_args
from trainfit.errors import ConfigError
from trainfit.commands.report import save_and_report
from trainfit.integrations.frameworks import FRAMEWORKS, FROM_FORMATS, LOSSES, FrameworkVerifyReport, verify_framework
from trainfit.integrations.read_config import RUN_KEYS, TOOL_LABELS, file_values, load_mapping, read_from
from trainfit.outputs import check_run_dir, dumps_json
from trainfit.probes.verify import NOISE_MARGIN, verify
from trainfit.results import VerifyReport

EXIT_FAILED = 1
"""Exit status when the check ran and failed (2 stays for bad input)."""


def register(sub) -> None:
    p = sub.add_parser("verify", help="check one step of the configured levers against the fp32 reference")
    add_run_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--report", action="store_true", help="also save RUN_DIR/verify.json and write RUN_DIR/report.html")
    p.add_argument("--framework", choices=FRAMEWORKS, default=None,
                   help="run THAT tool's own optimizer step with accumulation and without, on micro-batches with "
                        "uneven target counts: reports its accumulation error (exit 1) apart from its normalisation "
                        "difference to the fp32 token mean (hf-trainer: --model hf:DIR or hf:<Class>, any head)")
    p.add_argument("--framework-loss", choices=LOSSES, default="default",
                   help="with --framework accelerate|lightning: the loop's loss, the micro-batch mean (default) or "
                        "token-weighted (sum / the window's token count, the fix)")
    p.add_argument("--from", dest="from_file", metavar="FILE",
                   help="the job from a transformers TrainingArguments JSON, an accelerate config YAML or Lightning "
                        "Trainer arguments (flags override it); with --framework hf-trainer the Trainer runs with "
                        "those TrainingArguments")
    p.set_defaults(func=run)


def format_report(r: VerifyReport) -> str:
    tol = r.tolerance
    lines = [
        f"verify {r.precision} / {r.strategy}: micro-batch {r.micro_batch} x accumulation "
        f"{r.accumulation} x {r.world_size} rank(s) = global batch {r.global_batch}",
        f"  gradient cosine       {r.grad_cosine:.8f}   (>= {tol.min_cosine})",
        f"  gradient rel. error   {r.grad_rel_error:.3e}   (<= {tol.max_grad_rel_error})",
        f"  gradient norm ratio   {r.grad_norm_ratio:.6g}",
        f"  update max rel. error {r.update_max_rel_error:.3e}   (<= {update_bound(r)})",
        f"  skipped steps         {r.skipped_steps}   (loss scale {r.loss_scale:g})",
        f"  fp16 underflow        {r.fp16_underflow_frac:.2%} of gradient values flush to zero in fp16 "
        "without loss scaling",
        "PASS" if r.passed else "FAIL: " + "; ".join(r.causes),
    ]
    return "\n".join(lines)


def update_bound(r: VerifyReport) -> str:
    """The update's bound and which one it was: the precision's tolerance, or the noise floor measured in the
    same call (when only the update was outside the tolerance; see ``probes.verify.NoiseFloor``)."""
    tol = r.tolerance.max_update_rel_error
    if r.extra.get("update_bound_kind") != "noise floor":
        return f"{tol}, the {r.precision} tolerance"
    x = r.extra
    return (f"{x['update_bound']:.3e}: {NOISE_MARGIN:g} x the noise floor measured here -- the reference optimizer "
            f"stepped with this run's gradient {x['noise_floor_run_gradient']:.3e}, the eager reference summed in "
            f"reverse order {x['noise_floor_reordered']:.3e} (its gradient {x['noise_floor_reordered_grad']:.1e}); "
            f"above the {r.precision} tolerance {tol}")


def format_framework(r: FrameworkVerifyReport) -> str:
    tol, acc, norm = r.tolerance, r.accumulation_error, r.normalisation
    k, m = r.accumulation, r.micro_batch
    lines = [
        f"verify --framework {r.framework} ({r.loss} loss): {r.model}, {r.head}, micro-batch {m} x accumulation {k}, "
        f"targets per micro-batch {'/'.join(map(str, r.loss_tokens))}",
        *(f"  read                   {s}" for s in r.settings),
        f"  what it did            {r.path}",
        f"  accumulation error     {acc.rel_error:.3e}   ({r.framework} at {m} x {k} vs at {m * k} x 1; "
        f"<= {tol.max_grad_rel_error}, norm ratio {acc.norm_ratio:.6g}){': FOUND' if acc.found else ''}",
        *_explanation(acc),
        f"  normalisation diff.    {norm.rel_error:.3e}   ({r.framework} at {m * k} x 1 vs the token mean; norm ratio "
        f"{norm.norm_ratio:.6g}){': differs (reported, not a failure)' if norm.found else ''}",
        *_explanation(norm),
        f"  vs mean of means       {r.mean_of_means_rel_error:.3e}",
        "PASS" + (" (the tool's loss is not the token mean: see normalisation)" if norm.found else "") if r.passed
        else f"FAIL: accumulation error ({r.framework}'s gradient at {m} x {k} is not its gradient at {m * k} x 1)",
    ]
    return "\n".join(lines)


def _explanation(d) -> list[str]:
    if not d.found:
        return []
    return [f"    cause: {d.cause}", *([f"    fix: {d.fix}"] if d.fix else [])]


def _from_file(args, framework: str | None) -> tuple[dict, dict | None, tuple[str, ...]]:
    """``--from FILE``: (RunConfig overrides the file sets, the raw TrainingArguments mapping for hf-trainer,
    lines saying what was read). Flags override the file."""
    if not args.from_file:
        return {}, None, ()
    found = read_from(args.from_file)
    if framework is not None and found.tool != FROM_FORMATS[framework]:
        raise ConfigError("from", args.from_file, f"a {TOOL_LABELS[FROM_FORMATS[framework]]} file with --framework "
                          f"{framework}", f"its keys are {TOOL_LABELS[found.tool]}")
    given = {k: getattr(args, k, None) for k in RUN_KEYS}
    applied, overridden = file_values(found, given)
    keys = ("micro_batch", "accumulation") if framework else RUN_KEYS  # the tool runs fp32, one process
    overrides = {k: v for k, v in applied.items() if k in keys}
    unused = [f"{k}={v}" for k, v in applied.items() if k not in keys]
    lines = [*found.lines(overridden)]
    if unused:
        why = "the check runs in fp32, in one process" if framework else "ranks come from torchrun"
        lines.append(f"trainfit: not applied from {args.from_file}: {', '.join(unused)} ({why})")
    user = load_mapping(args.from_file) if framework == "hf-trainer" else None
    return overrides, user, tuple(lines)


def run_framework(args) -> int:
    if args.report:
        raise ConfigError("report", True, "no --report with --framework", "print it, or save the --json output")
    overrides, user, lines = _from_file(args, args.framework)
    cfg = config_from_args(args, **overrides)
    for line in lines:
        print(line, file=sys.stderr)
    report = verify_framework(cfg, framework=args.framework, loss=args.framework_loss, user_args=user,
                              settings=tuple(ln.removeprefix("trainfit: ") for ln in lines),
                              say=lambda line: print(f"trainfit: {line}", file=sys.stderr))
    print(dumps_json(report.to_dict()) if args.json else format_framework(report))
    return 0 if report.passed else EXIT_FAILED


def run(args) -> int:
    if args.framework is not None:
        return run_framework(args)
    if args.framework_loss != "default":
        raise ConfigError("framework_loss", args.framework_loss, "default without --framework",
                          "add --framework accelerate or --framework lightning")
    overrides, _, lines = _from_file(args, None)
    cfg = config_from_args(args, **overrides)
    for line in lines:
        print(line, file=sys.stderr)
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
