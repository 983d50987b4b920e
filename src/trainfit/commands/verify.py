"""``trainfit verify``: one step of the configured levers against the fp32 big-batch reference."""

from __future__ import annotations

import torch.distributed as dist

from trainfit.commands.flags import config_from_args
from trainfit.commands.report import save_and_report
from trainfit.errors import ConfigError
from trainfit.front.verify import read_from_file, verify, verify_framework
from trainfit.integrations.frameworks import FrameworkVerifyReport
from trainfit.integrations.read_config import RUN_KEYS
from trainfit.outputs import check_run_dir, dumps_json
from trainfit.probes.verify import NOISE_MARGIN
from trainfit.progress import info
from trainfit.results import VerifyReport

EXIT_FAILED = 1
"""Exit status when the check ran and failed (2 stays for bad input)."""
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


def _read(args, framework: str | None):
    """``--from FILE`` (flags override it) -> (the RunConfig, what the file gave); the file's lines said after
    the job is accepted."""
    read = read_from_file(args.from_file, framework, {k: getattr(args, k, None) for k in RUN_KEYS})
    cfg = config_from_args(args, **read.overrides)
    for line in read.lines:
        info("verify", line)
    return cfg, read


def run_framework(args) -> int:
    if args.report:
        raise ConfigError("report", True, "no --report with --framework", "print it, or save the --json output")
    cfg, read = _read(args, args.framework)
    report = verify_framework(cfg, framework=args.framework, loss=args.framework_loss, user_args=read.user_args,
                              settings=tuple(ln.removeprefix("trainfit: ") for ln in read.lines),
                              collator=args.collator, trainer=args.trainer)
    print(dumps_json(report.to_dict()) if args.json else format_framework(report))
    return 0 if report.passed else EXIT_FAILED


def run(args) -> int:
    if args.framework is not None:
        return run_framework(args)
    if args.framework_loss != "default":
        raise ConfigError("framework_loss", args.framework_loss, "default without --framework",
                          "add --framework accelerate or --framework lightning")
    for key in ("collator", "trainer"):
        if getattr(args, key):
            raise ConfigError(key, getattr(args, key), "a setting of --framework hf-trainer",
                              "add --framework hf-trainer; trainfit's own verify runs its own loop")
    cfg, _ = _read(args, None)
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
