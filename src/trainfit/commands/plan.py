"""``trainfit plan``: choose precision, micro-batch, accumulation, checkpointing and strategy before running.

The work is :func:`trainfit.front.plan.plan`; this module turns the flags (and ``--from``) into its
:class:`~trainfit.front.plan.PlanRequest`, prints the report (the table, or ``--json``) and writes the files.
"""

from __future__ import annotations

import argparse
import sys

from trainfit.commands.report import save_and_report
from trainfit.config import SECTION_OF, SECTIONS, dump_toml
from trainfit.errors import TrainfitError
from trainfit.front.plan import (
    CHECKPOINT_CHOICES,
    FILE_DATA_FLAGS,
    OFFLOAD_FLAG,
    PlanRequest,
    export_for,
    format_explain,
    format_plan,
    plan,
    run_config,
    subsets,
)
from trainfit.gate import check_write_target
from trainfit.integrations.export_plan import TOOLS, check_write_for
from trainfit.meters.devices import DEVICES
from trainfit.outputs import check_output_file, check_run_dir, dumps_json
from trainfit.presets import MODEL_HELP
from trainfit.progress import info
from trainfit.vocabulary import Optimizer, choices

GROUPS = (*SECTIONS, "output")
"""``plan --help``'s groups: the config's sections (``trainfit.config.SECTIONS``), then what is printed and
written."""

PLAN_ONLY = {
    "from_file": "run", "device_memory": "distribution", "nodes": "distribution", "device": "distribution",
    "bandwidth_intra": "distribution", "bandwidth_inter": "distribution", "headroom": "distribution",
    "strategies": "distribution", "precisions": "levers", "checkpointings": "levers", "offloads": "levers",
    "compile_speedup": "levers", "basis": "run", "calibrate": "run", "top": "output", "explain": "output",
    "json": "output", "report": "output", "write": "output", "write_for": "output", "force": "output",
}
"""The group of each flag that is not a RunConfig field (those go to their section, ``config.SECTION_OF``)."""

DESCRIPTIONS = {"levers": "the choices searched (default: all of each)",
                "distribution": "the devices: --devices per node x --nodes in all",
                "run": "where the job and the numbers come from", "output": "what is printed and written"}


def register(sub) -> None:
    p = sub.add_parser("plan", help="choose the levers for a job so it fits and runs fastest", add_help=False)
    groups = {name: p.add_argument_group(name, DESCRIPTIONS.get(name)) for name in GROUPS}

    def add(*flags, dest: str, **kw) -> None:
        groups[PLAN_ONLY.get(dest) or SECTION_OF[dest]].add_argument(*flags, dest=dest, **kw)

    add("--model", dest="model", default="gpt-tiny", help=MODEL_HELP)
    add("--model-config", dest="model_config", default="", help="key=value,... overrides")
    add("--lora", dest="lora", default="", help="plan for LoRA adapters as train takes them: r=8,alpha=16,"
                                                "targets=q_proj,v_proj (only the adapters train)")
    add("--freeze", dest="freeze", default="", help="comma-separated glob patterns of parameter names frozen, as "
                                                    "train takes them (no gradients, no optimizer state)")
    add("--seq", "--seq-len", dest="seq_len", default="64", help="sequence length in tokens")
    for key, help_text in FILE_DATA_FLAGS.items():
        add("--" + key.replace("_", "-"), dest=key, help=help_text)
    add("--global-batch", dest="global_batch", help="samples per optimizer step over all devices (required "
                                                    "unless --from sets a per-device batch)")
    add("--devices", dest="devices", help="devices per node, as torchrun's --nproc_per_node and Lightning's "
                                          "devices (default 1); the plan is for devices x nodes in all")
    add("--nodes", dest="nodes", help="nodes, each with --devices devices (default 1)")
    add("--device-memory", dest="device_memory", required=True, help="memory per device, e.g. 80GiB")
    add("--device", dest="device", default="h100", help=f"the device to plan for: {choices(DEVICES)} (default h100)")
    add("--bandwidth-intra", dest="bandwidth_intra", help="per-device bandwidth inside a node, e.g. 450GB/s")
    add("--bandwidth-inter", dest="bandwidth_inter", help="per-device bandwidth between nodes, e.g. 50GB/s")
    add("--headroom", dest="headroom", default="0.1", help="share of device memory kept free (default 0.1)")
    add("--strategies", dest="strategies", help=f"comma-separated subset of {', '.join(subsets()['strategies'])}")
    add("--precisions", dest="precisions", help=f"comma-separated subset of {', '.join(subsets()['precisions'])}")
    add("--checkpointings", dest="checkpointings",
        help=f"comma-separated subset of {', '.join(CHECKPOINT_CHOICES)}, or every:K, selective, budget:F "
             "(default: none, every:2, full; none, full for a traced basis)")
    add("--offloads", dest="offloads", help="comma-separated subset of " + ", ".join(OFFLOAD_FLAG)
        + ": what the search may keep in host memory, each priced at the host link (default: all of them where "
          "the device row has a host link or --calibrate measures one on cpu; none otherwise)")
    add("--compile-speedup", dest="compile_speedup", metavar="F|measure",
        help="add torch.compile (per block) to the search, its compute priced at F times the eager step's speed "
             "(a ratio you measured, e.g. with `trainfit profile --compile on` on the device), or `measure` (cpu): "
             "eager and compiled steps of this model, interleaved (a compile per (precision, checkpointing) pair: "
             "minutes when inductor's cache is cold)")
    add("--optimizer", dest="optimizer", help=f"{choices(Optimizer)} (default adamw, or the --from file's)")
    add("--from", dest="from_file", metavar="FILE",
        help="the job of a transformers TrainingArguments JSON, an accelerate config YAML or Lightning Trainer "
             "arguments: global batch, devices, nodes (flags override it); says where its own configuration ranks")
    add("--basis", dest="basis", default="auto", help="auto, analytic, estimate or measure: where the parts come from")
    add("--calibrate", dest="calibrate", action="store_true",
        help="cpu: fit the compute rate to a few measured steps of this model (under 2 min); with more than one "
             "device also the distributed overhead, measured on 2 gloo processes (~1 min). A GPU row on a machine "
             "with CUDA: measure this device's GEMM rates, memory and host-link bandwidth and plan with them")
    add("--run-dir", dest="run_dir", default="runs/default", help="where --report writes (default runs/default)")
    _add_output_flags(add)
    groups["output"].add_argument("-h", "--help", action="help", help="show this help and exit")
    p.set_defaults(func=run)


def _add_output_flags(add) -> None:
    add("--top", dest="top", default="10", help="entries to show")
    add("--explain", dest="explain", metavar="N",
        help="break row N's step into compute-bound, memory-bound, recompute, exposed communication and fixed cost "
             "(and in --json)")
    add("--json", dest="json", action="store_true", help="print one JSON object on stdout")
    add("--report", dest="report", action="store_true",
        help="also save RUN_DIR/plan.json and write RUN_DIR/report.html")
    add("--write", dest="write", metavar="PLAN.toml", help="write the best plan as a config `trainfit train` runs")
    add("--write-for", dest="write_for", nargs=2, metavar=("TOOL", "FILE"),
        help=f"write the best plan as {choices(TOOLS)}'s own configuration (TrainingArguments JSON, accelerate "
             "config YAML, Lightning Trainer/Fabric JSON); prints what the tool cannot express")
    add("--force", dest="force", action="store_true", help="let --write / --write-for replace an existing file")


REQUEST_FIELDS = ("model", "model_config", "global_batch", "seq_len", "device_memory", "devices", "nodes", "device",
                  "bandwidth_intra", "bandwidth_inter", "optimizer", "lora", "freeze", *FILE_DATA_FLAGS, "headroom",
                  "basis", "calibrate", "compile_speedup", "precisions", "checkpointings", "offloads", "strategies",
                  "top", "explain", "from_file")
"""The flags that are :class:`PlanRequest` fields of the same name."""


def request_of(args: argparse.Namespace) -> PlanRequest:
    """The flags as a :class:`PlanRequest` (checked, with ``--from`` read): refused before any work."""
    write_for = getattr(args, "write_for", None)
    return PlanRequest(**{k: getattr(args, k, None) for k in REQUEST_FIELDS if getattr(args, k, None) is not None},
                       write_for=write_for[0] if write_for else None)


def check_outputs(args: argparse.Namespace) -> dict:
    """``--write``, ``--write-for`` and ``--report``'s run directory, checked before any work: a file to write is
    new or a regular file (``gate.check_write_target``: a named pipe would block the write, a device be written)."""
    if args.write:
        check_write_target("write", args.write)
    if args.write_for:
        check_write_target("write-for", args.write_for[1])
    return dict(write_for=check_write_for(args.write_for, force=args.force) if args.write_for else None,
                write=check_output_file("write", args.write, force=args.force, suffix=".toml") if args.write else None,
                run_dir=check_run_dir(args.run_dir) if args.report else None)


def run(args) -> int:
    request = request_of(args)  # every flag and output path refused before any work
    outputs = check_outputs(args)
    for line in request.alias_notes:
        info("plan", line)
    for line in (request.source.lines(request.overridden) if request.source is not None else ()):
        info("plan", line)  # --from: what was read from the other tool's file, what ignored
    report = plan(request)
    if report.best is None:  # the candidates and why each fails (stderr), then a refusal: exit 2, nothing written
        print(format_plan(report), file=sys.stderr)
        wanted = [f for f, v in (("--write", outputs["write"]), ("--write-for", outputs["write_for"]),
                                 ("--report", outputs["run_dir"])) if v is not None]
        raise TrainfitError("plan: nothing fits, so there is no plan to run"
                            + (f" and nothing was written ({', '.join(wanted)})" if wanted else "") + ": "
                            + "; ".join(n for n in report.notes if n.startswith("nothing fits")))
    toml_text = dump_toml(run_config(request, report)) if outputs["write"] is not None else None
    exported = export_for(request, report, outputs["write_for"][0]) if outputs["write_for"] is not None else None
    text = dumps_json(report.to_dict()) if args.json or args.report else None  # strict JSON, before any write
    # Everything that could refuse has run: only now is anything written.
    if toml_text is not None:
        outputs["write"].write_text(toml_text)
    if exported is not None:
        outputs["write_for"][1].write_text(exported.text)
        print(f"wrote {outputs['write_for'][1]} for {exported.tool}; what it cannot express exactly:", file=sys.stderr)
        for gap in exported.gaps:
            print("  " + gap.line(), file=sys.stderr)
    if args.report:
        save_and_report(args.run_dir, "plan.json", report.to_dict(), report=True)  # claims the run dir checked above
    if args.json:
        print(text)
        return 0
    print(format_plan(report))
    if "explain" in report.extra:
        print(format_explain(report.extra["explain"]))
    if toml_text is not None:
        print(f"wrote {outputs['write']}: run it with `trainfit train {outputs['write']}`", file=sys.stderr)
    return 0
