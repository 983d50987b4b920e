"""``trainfit plan``: choose precision, micro-batch, accumulation, checkpointing and strategy before running.

The work is :func:`trainfit.front.plan.plan`; this module turns the flags (and ``--from``) into its
:class:`~trainfit.front.plan.PlanRequest`, prints the report (the table, or ``--json``) and writes the files.
"""

from __future__ import annotations

import argparse
import sys

from trainfit.commands.report import save_and_report
from trainfit.config import dump_toml
from trainfit.errors import TrainfitError
from trainfit.front.plan import (
    FILE_DATA_FLAGS,
    PlanRequest,
    export_for,
    format_explain,
    format_plan,
    plan,
    run_config,
)
from trainfit.gate import check_write_target
from trainfit.integrations.export_plan import check_write_for
from trainfit.outputs import check_output_file, check_run_dir, dumps_json
from trainfit.progress import info

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
