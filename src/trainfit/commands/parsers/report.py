"""``trainfit report``'s flags (the command: :mod:`trainfit.commands.report`)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("report", help="write RUN_DIR/report.html (loss, memory, step time, plan, advice)")
    p.add_argument("run_dir", help="a run directory (metrics.jsonl, memory.json, profile.json, plan.json)")
    p.add_argument("--out", help="where to write the page (default RUN_DIR/report.html); must not exist unless --force")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument("--json", action="store_true", help="print {\"report\": PATH} on stdout")
