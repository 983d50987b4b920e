"""``trainfit memory``: what fills memory in one optimizer step, measured or estimated.

    trainfit memory --model gpt-tiny --batch 8 --precision bf16-mixed
    trainfit memory --model hf:LlamaForCausalLM --model-config hidden_size=4096,... --seq 4096 \
        --estimate --budget 80GiB --json

The work is :func:`trainfit.front.memory.estimate_memory` / :func:`~trainfit.front.memory.measure_memory`; this
module turns flags and TOML into their arguments and prints the report (a table, or ``--json``).
"""

from __future__ import annotations

from trainfit.commands.flags import config_from_args
from trainfit.commands.report import save_and_report
from trainfit.errors import ConfigError
from trainfit.front import memory as front
from trainfit.gate import check_write_target
from trainfit.integrations.read_config import RUN_KEYS, file_values, read_from
from trainfit.outputs import check_output_file, check_run_dir, dumps_json
from trainfit.progress import info
from trainfit.report.plots import plot_memory
from trainfit.strategies import launch
from trainfit.strategies import process_group as pg
from trainfit.units import fmt_bytes, parse_bytes
from trainfit.vocabulary import PART_LABELS

JSON_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temporaries_bytes",
             "peak_bytes", "peak_phase", "activations_per_sample_bytes")
"""Keys --json always prints (plus max_micro_batch with --budget, and the full report)."""

SCALING_KEYS = ("activations_per_sample_bytes", "scaling", "per_rank", "budget_bytes", "max_micro_batch")
"""What the front door adds to the report's ``extra`` (printed by --json, not stored in memory.json)."""


def _from_file(args, overrides: dict):
    """``--from FILE``: the other tool's file < explicit flags (said on stderr); (found, overridden, overrides)."""
    if not args.from_file:
        return None, {}, overrides
    found = read_from(args.from_file)
    given = {k: getattr(args, k, None) for k in RUN_KEYS} | overrides | {"devices": args.devices}
    applied, overridden = file_values(found, given)
    args.devices = applied.pop("devices", args.devices)  # the file's devices count every rank
    applied.pop("nodes", None)  # counted in the file's devices already
    for line in found.lines(overridden):
        info("memory", line)
    return found, overridden, applied | overrides


def run(args) -> int:
    overrides = {"micro_batch": args.batch} if args.batch is not None else {}
    found, overridden, overrides = _from_file(args, overrides)
    args.devices = 1 if args.devices is None else args.devices
    nodes = 1 if args.nodes is None else args.nodes
    sources = {k: f"{k} = {v} in {found.path} (--from)" for k, v in overrides.items()} if found else {}
    if args.batch is not None:
        sources["micro_batch"] = f"--batch {args.batch}"
    cfg = config_from_args(args, ranks=args.devices * nodes if args.method == "estimate" else None, sources=sources,
                           **overrides)
    front.check_ranks(args.devices, nodes)
    budget = parse_bytes("budget", args.budget) if args.budget is not None else None
    if args.plot:  # every output path is checked before any work
        check_write_target("--plot", args.plot)  # a named pipe or device would block the write
        check_output_file("--plot", args.plot, force=args.force, suffix=".png")
    if args.report:
        check_run_dir(cfg.run_dir)
    if args.method != "estimate":
        if args.devices != 1 or nodes != 1:
            flag, value = ("devices", args.devices) if args.devices != 1 else ("nodes", nodes)
            raise ConfigError(flag, value, "1 when measuring", "add --estimate, or measure each rank by "
                              "launching `torchrun --nproc_per_node=N -m trainfit memory --strategy ...`")
        if args.target != "cpu":
            raise ConfigError("device", args.target, "cpu when measuring (this machine)", "add --estimate to trace "
                              f"the step with {args.target}'s kernels")
    where = {"devices": args.devices, "nodes": nodes, "device": args.target} if args.method == "estimate" else {}
    if args.compare_checkpointing is not None:
        rows = front.compare_checkpointing(cfg, specs=args.compare_checkpointing, method=args.method, **where)
        print(dumps_json({"method": args.method, "compare_checkpointing": rows}) if args.json
              else format_comparison(cfg, args.method, rows))
        return 0
    if args.method == "estimate":  # under torchrun every rank traces; rank 0 reports (measure joins by itself)
        launch.join_if_launched(timeout_s=cfg.collective_timeout_s)
    call = front.estimate_memory if args.method == "estimate" else front.measure_memory
    report = call(cfg, budget=budget, **where)
    world = pg.current()
    if world is not None and world.rank != 0:
        return 0
    _outputs(args, cfg, report, budget, found, overridden)
    return 0


def _outputs(args, cfg, report, budget, found, overridden) -> None:
    """The plot, the stored report, and the table or JSON on stdout."""
    stored = {k: v for k, v in report.to_dict().items() if k not in SCALING_KEYS}
    if args.plot:
        plot_memory(report, args.plot, budget_bytes=budget)
    if args.report:
        save_and_report(cfg.run_dir, "memory.json", stored, report=True,
                        keep_others=("precision", "checkpointing", "strategy", "batch", "method"))
    if args.json:
        out = stored
        if found is not None:
            out["from"] = found.to_dict(overridden)
        out |= {k: report.extra[k] for k in SCALING_KEYS if k in report.extra}
        print(dumps_json(out))
    else:
        print(format_table(report, budget))
        for r, parts in enumerate(report.extra.get("per_rank") or []):
            print(f"rank {r}: " + ", ".join(f"{k} {v:,} B" for k, v in parts.items()))


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


def format_table(report, budget=None) -> str:
    r = report
    scaling = r.extra["scaling"]
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
    lines.append(f"activations per sample: {fmt_bytes(scaling['activations_per_sample_bytes'])} "
                 f"(fit over micro-batches {', '.join(map(str, scaling['batches']))})")
    if budget:
        lines.append(f"largest micro-batch within {fmt_bytes(budget)}: {r.extra['max_micro_batch']}")
    if r.device_max_allocated_bytes is not None:
        lines.append(f"torch.cuda.max_memory_allocated {fmt_bytes(r.device_max_allocated_bytes)}, "
                     f"reserved {fmt_bytes(r.device_max_reserved_bytes)}")
    lines.append(r.lever_line)
    lines.extend(r.notes)
    if r.top_modules:
        lines.append("top modules by activation bytes: " +
                     ", ".join(f"{n} {fmt_bytes(b)}" for n, b in r.top_modules[:5]))
    return "\n".join(lines)


def format_comparison(cfg, method: str, rows: list[dict]) -> str:
    lines = [f"{cfg.model}: {cfg.precision}, micro-batch {cfg.micro_batch} x seq {cfg.seq_len}, accumulation "
             f"{cfg.accumulation} ({method}d; recompute FLOPs counted by FlopCounterMode per step)",
             f"{'checkpointing':<16}{'saved bytes':>14}{'peak':>12}{'recompute FLOPs':>17}{'of the step':>13}"]
    for r in rows:
        share = r["recompute_flops"] / r["model_flops"] if r["model_flops"] else 0.0
        lines.append(f"{r['checkpointing']:<16}{fmt_bytes(r['activations_bytes']):>14}{fmt_bytes(r['peak_bytes']):>12}"
                     f"{r['recompute_flops']:>17,}{share:>13.1%}")
    return "\n".join(lines)
