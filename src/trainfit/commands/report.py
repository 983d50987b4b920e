"""``trainfit report RUN_DIR``: one self-contained HTML page of what the run directory holds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainfit.report import write_report
from trainfit.report.data import read_docs


def register(sub) -> None:
    p = sub.add_parser("report", help="write RUN_DIR/report.html (loss, memory, step time, plan, advice)")
    p.add_argument("run_dir", help="a run directory (metrics.jsonl, memory.json, profile.json, plan.json)")
    p.add_argument("--out", help="where to write the page (default RUN_DIR/report.html)")
    p.add_argument("--json", action="store_true", help="print {\"report\": PATH} on stdout")
    p.set_defaults(func=run)


def run(args) -> int:
    path = write_report(args.run_dir, args.out)
    if args.json:
        print(json.dumps({"report": str(path)}))
    else:
        print(f"report written to {path}", file=sys.stderr)
    return 0


def save_and_report(run_dir, name: str, doc, *, report: bool, keep_others: tuple[str, ...] = ()) -> None:
    """Store a command's JSON object as RUN_DIR/<name> (what the report reads); render when asked.

    With ``keep_others`` (e.g. the memory report's precision/checkpointing/strategy/batch), objects already in
    the file that differ in those keys are kept, so runs of several configurations make one bar each.
    """
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    docs = [doc]
    if keep_others:
        key = tuple(doc.get(k) for k in keep_others)
        old = [d for d in read_docs(root / name, [])
               if isinstance(d, dict) and tuple(d.get(k) for k in keep_others) != key]
        docs = old + [doc]
    (root / name).write_text(json.dumps(docs if len(docs) > 1 else doc, indent=1, default=str))
    if report:
        run_report(root)


def run_report(run_dir) -> None:
    print(f"report written to {write_report(run_dir)}", file=sys.stderr)
