"""``trainfit memory``: what fills memory in one optimizer step, measured or estimated.

    trainfit memory --model gpt-tiny --batch 8 --precision bf16-mixed
    trainfit memory --model hf:LlamaForCausalLM --model-config hidden_size=4096,... --seq 4096 \
        --estimate --budget 80GiB --json
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch

from trainfit.commands.flags import add_run_flags, config_from_args
from trainfit.commands.report import save_and_report
from trainfit.errors import ConfigError, check_int
from trainfit.integrations.read_config import RUN_KEYS, file_values, read_from
from trainfit.meters.devices import DEVICES, device_row
from trainfit.outputs import check_output_file, check_run_dir, dumps_json
from trainfit.probes.batchfit import fit_batch_scaling, second_batch
from trainfit.probes.compile import compiled_saved_bytes
from trainfit.probes.estimate import estimate_memory
from trainfit.probes.memory import example_batch, measure_memory
from trainfit.probes.profile import task_flop_counter
from trainfit.report.plots import plot_memory
from trainfit.strategies import launch
from trainfit.strategies import process_group as pg
from trainfit.tasks.files import load_text_data
from trainfit.tasks.spec import DataSpec
from trainfit.units import fmt_bytes, parse_bytes
from trainfit.run import task_of
from trainfit.vocabulary import PART_LABELS, parse_checkpoint_policy

JSON_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temporaries_bytes",
             "peak_bytes", "peak_phase", "activations_per_sample_bytes")
"""Keys --json always prints (plus max_micro_batch with --budget, and the full report)."""


def register(sub) -> None:
    p = sub.add_parser("memory", help="what fills memory in one step: parameters, gradients, optimizer, activations")
    add_run_flags(p)
    p.add_argument("--batch", type=int, help="samples per micro-batch (same as --micro-batch)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--measure", dest="method", action="store_const", const="measure",
                     help="run two real steps and measure the second (default)")
    how.add_argument("--estimate", dest="method", action="store_const", const="estimate",
                     help="trace the step under fake tensors: nothing is allocated (for models too big here)")
    p.add_argument("--from", dest="from_file", metavar="FILE",
                   help="read the job from a transformers TrainingArguments JSON, an accelerate config YAML or "
                        "Lightning Trainer arguments (flags override it)")
    p.add_argument("--devices", "--world", dest="devices", type=int, default=None,
                   help="with --estimate: devices (ranks) to spread --strategy over (per-rank bytes, no processes "
                        "launched)")
    p.add_argument("--device", dest="target", default="cpu",
                   help="with --estimate: the device whose kernels the trace follows (attention, dropout, autocast, "
                        "optimizer as they run there): " + ", ".join(DEVICES) + " (default cpu: this machine's)")
    p.add_argument("--budget", help="device memory to fit, e.g. 24GiB: prints the largest micro-batch that fits")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--compare-checkpointing", metavar="SPECS",
                   help="one row per checkpointing policy, side by side: saved (activation) bytes, peak and "
                        "recompute FLOPs, e.g. none,selective,full,budget:0.5,every:2")
    p.add_argument("--plot", metavar="FILE.png", help="write a stacked bar per phase")
    p.add_argument("--report", action="store_true", help="also save RUN_DIR/memory.json and write RUN_DIR/report.html")
    p.add_argument("--force", action="store_true", help="replace an existing --plot file")
    p.set_defaults(func=run, method="measure")


def run(args) -> int:
    overrides = {"micro_batch": args.batch} if args.batch is not None else {}
    found, overridden = (read_from(args.from_file), {}) if args.from_file else (None, {})
    if found is not None:  # the other tool's file < explicit flags (said on stderr)
        given = {k: getattr(args, k, None) for k in RUN_KEYS} | overrides | {"devices": args.devices}
        applied, overridden = file_values(found, given)
        args.devices = applied.pop("devices", args.devices)
        applied.pop("nodes", None)  # --estimate counts ranks, not machines
        overrides = applied | overrides
        for line in found.lines(overridden):
            print(line, file=sys.stderr)
    args.devices = 1 if args.devices is None else args.devices
    cfg = config_from_args(args, **overrides)
    check_int("devices", args.devices, minimum=1)
    budget = parse_bytes("budget", args.budget) if args.budget is not None else None
    if args.plot:  # every output path is checked before any work
        check_output_file("--plot", args.plot, force=args.force, suffix=".png")
    if args.report:
        check_run_dir(cfg.run_dir)
    world = launch.join_if_launched(timeout_s=cfg.collective_timeout_s)  # torchrun: measure inside each rank
    if args.devices != 1 and args.method != "estimate":
        raise ConfigError("devices", args.devices, "1 when measuring", "add --estimate, or measure each rank by "
                          "launching `torchrun --nproc_per_node=N -m trainfit memory --strategy ...`")
    device_row(args.target)  # an unknown device is refused before any work
    if args.target != "cpu" and args.method != "estimate":
        raise ConfigError("device", args.target, "cpu when measuring (this machine)", "add --estimate to trace the "
                          f"step with {args.target}'s kernels")
    if args.method == "estimate":
        make_report = functools.partial(estimate_memory, world_size=args.devices, strategy=cfg.strategy,
                                        target=args.target)
    else:
        make_report = measure_memory
    if args.compare_checkpointing is not None:
        rows = compare_checkpointing(cfg, args.compare_checkpointing, make_report)
        print(dumps_json({"method": args.method, "compare_checkpointing": rows}) if args.json
              else format_comparison(cfg, args.method, rows))
        return 0
    report = make_report(cfg)
    if cfg.compile:  # the step above ran (or was traced) eagerly: say what the compiled step saves instead
        report = dataclasses.replace(report, notes=(*report.notes, compile_note(cfg, args.method, world)))
    if cfg.data:  # rows from files: the sizing batch is the longest micro-batch this data produces
        longest = load_text_data(DataSpec.from_config(cfg)).longest  # cached: read once by the task already
        print(f"trainfit: activations sized for rows of {longest} tokens, the longest this data produces"
              + (" (packing: full seq_len)" if cfg.packing else ""), file=sys.stderr)
    other = make_report(cfg, batch=second_batch(report.batch))
    scaling = fit_batch_scaling(cfg, batches=(report.batch, other.batch), reports=(report, other))
    # Under torchrun each rank measured its own shards; rank 0 reports them all.
    per_rank = pg.gather_to_rank0({p: report.parts[p] for p in ("params", "grads", "optimizer")}) if world else None
    if world is not None and world.rank != 0:
        return 0
    max_mb = scaling.max_micro_batch(budget) if budget else None
    if args.plot:
        plot_memory(report, args.plot, budget_bytes=budget)
    if args.report:
        save_and_report(cfg.run_dir, "memory.json", report.to_dict(), report=True,
                        keep_others=("precision", "checkpointing", "strategy", "batch", "method"))
    if args.json:
        out = report.to_dict()
        if found is not None:
            out["from"] = found.to_dict(overridden)
        out["activations_per_sample_bytes"] = round(scaling.activations_per_sample_bytes)
        out["scaling"] = scaling.to_dict()
        if per_rank:
            out["per_rank"] = per_rank
        if budget:
            out["budget_bytes"] = budget
            out["max_micro_batch"] = max_mb
        print(dumps_json(out))
    else:
        print(format_table(report, scaling, budget, max_mb))
        for r, parts in enumerate(per_rank or []):
            print(f"rank {r}: " + ", ".join(f"{k} {v:,} B" for k, v in parts.items()))
    return 0


def compile_note(cfg, method: str, world) -> str:
    """``--compile on``: the tracker's dispatch mode keeps dynamo from compiling (measured: 0 graphs) and fake
    tensors cannot run compiled code, so the parts above are the eager step's; one line with what the compiled
    forward saves for backward, measured on one micro-batch here (``probes.compile.compiled_saved_bytes``)."""
    if method == "estimate" or world is not None:
        return ("compile: the parts above are the eager step's (fake tensors cannot run compiled code); on the "
                "built-in GPTs the compiled forward saved the same bytes for backward (docs/compile.md); "
                "`trainfit memory --compile on` without --estimate measures it for this model")
    # The tracked steps above ran under the tracker, and dynamo remembers the frames it skipped there: forget
    # them, or the compiled run below would run eagerly too (measured: 0 graphs).
    torch._dynamo.reset()
    c = compiled_saved_bytes(cfg)
    return (f"compile: the parts above are the eager step's (dynamo compiles nothing under the tracker); saved for "
            f"backward by one micro-batch, measured: eager {c.eager_bytes:,} B, compiled {c.compiled_bytes:,} B "
            f"({c.graphs} graphs, {c.scope}); the partitioner's estimate of the compiled regions is "
            f"{c.gap_frac:+.1%} from measured")


def offload_lines(r) -> list[str]:
    """With ``--offload``: per part, what stays on the device and what is in host memory."""
    if not r.host_bytes:
        return []
    lines = [f"{'offloaded':<17}{'on the device':>17}{'in host memory':>15}"]
    for part, label in PART_LABELS.items():
        device, host = fmt_bytes(r.device_bytes.get(part, 0)), fmt_bytes(r.host_bytes.get(part, 0))
        lines.append(f"{label:<17}{device:>17}{host:>15}")
    lines.append(f"{'device peak':<17}{fmt_bytes(r.device_peak):>17}")
    return lines


def format_table(report, scaling, budget, max_mb) -> str:
    r = report
    lines = [f"{r.model}: {r.precision}, checkpointing={r.checkpointing}, {r.optimizer}, micro-batch {r.batch} "
             f"x seq {r.seq_len}, accumulation {r.accumulation}, {r.n_params:,} params "
             f"({r.method} in {r.wall_s:.1f} s)",
             f"{'part':<17}{'largest in step':>17}{'at the peak':>15}"]
    for part, label in PART_LABELS.items():
        lines.append(f"{label:<17}{fmt_bytes(r.parts[part]):>17}{fmt_bytes(r.peak_parts.get(part, 0)):>15}")
    lines.append(f"{'peak':<17}{fmt_bytes(r.peak_bytes):>17}{'in ' + r.peak_phase:>15}")
    lines.extend(offload_lines(r))
    if r.master_weights_bytes:
        lines.append(f"  (optimizer state includes fp32 master weights: {fmt_bytes(r.master_weights_bytes)})")
    lines.append(f"activations per sample: {fmt_bytes(scaling.activations_per_sample_bytes)} "
                 f"(fit over micro-batches {', '.join(map(str, scaling.batches))})")
    if budget:
        lines.append(f"largest micro-batch within {fmt_bytes(budget)}: {max_mb}")
    if r.device_max_allocated_bytes is not None:
        lines.append(f"torch.cuda.max_memory_allocated {fmt_bytes(r.device_max_allocated_bytes)}, "
                     f"reserved {fmt_bytes(r.device_max_reserved_bytes)}")
    lines.append(r.lever_line)
    lines.extend(r.notes)
    if r.top_modules:
        lines.append("top modules by activation bytes: " +
                     ", ".join(f"{n} {fmt_bytes(b)}" for n, b in r.top_modules[:5]))
    return "\n".join(lines)


def compare_checkpointing(cfg, specs: str, make_report) -> list[dict]:
    """One row per policy in ``specs`` (comma-separated; ``class:A,B`` takes the names after it): the same
    run measured or estimated under each, and the recompute FLOPs ``FlopCounterMode`` counts for one step.

    Raises:
        ConfigError: a bad or empty spec, before any work.
    """
    parts: list[str] = []
    for part in (p.strip() for p in str(specs).split(",")):
        if part and parts and parts[-1].startswith("class:") and ":" not in part:
            parts[-1] += "," + part  # class:A,B
        elif part:
            parts.append(part)
    if not parts:
        raise ConfigError("compare_checkpointing", specs, "comma-separated policies, e.g. none,selective,full")
    policies = [parse_checkpoint_policy(p) for p in parts]  # every spec is checked before any work
    task = task_of(cfg)
    mbs = [example_batch(task, cfg.micro_batch)] * cfg.accumulation
    rows = []
    for policy in policies:
        r = make_report(dataclasses.replace(cfg, checkpointing=policy))
        flops = task_flop_counter(task, policy).step(mbs)
        rows.append({"checkpointing": policy.spec, "activations_bytes": r.activations_bytes,
                     "peak_bytes": r.peak_bytes, "peak_phase": r.peak_phase,
                     "model_flops": flops.model_flops, "recompute_flops": flops.hardware_flops - flops.model_flops})
    return rows


def format_comparison(cfg, method: str, rows: list[dict]) -> str:
    lines = [f"{cfg.model}: {cfg.precision}, micro-batch {cfg.micro_batch} x seq {cfg.seq_len}, accumulation "
             f"{cfg.accumulation} ({method}d; recompute FLOPs counted by FlopCounterMode per step)",
             f"{'checkpointing':<16}{'saved bytes':>14}{'peak':>12}{'recompute FLOPs':>17}{'of the step':>13}"]
    for r in rows:
        share = r["recompute_flops"] / r["model_flops"] if r["model_flops"] else 0.0
        lines.append(f"{r['checkpointing']:<16}{fmt_bytes(r['activations_bytes']):>14}{fmt_bytes(r['peak_bytes']):>12}"
                     f"{r['recompute_flops']:>17,}{share:>13.1%}")
    return "\n".join(lines)
