"""``trainfit report RUN_DIR``: one self-contained HTML page of what the run directory holds."""

from __future__ import annotations

import sys
from pathlib import Path

from trainfit.errors import ConfigError
from trainfit.gate import check_write_target
from trainfit.outputs import check_output_file, check_path_text, claim_run_dir, dumps_json, mark_non_finite, owns
from trainfit.report import write_report
from trainfit.report.data import REPORT, read_docs, write_text_atomic
from trainfit.report.html import PAGE_START, write_page


def run(args) -> int:
    root = check_report_dir(args.run_dir)
    target = report_target(root, args.out, force=args.force)  # checked before anything is read or written
    path, notes = write_page(root, target)
    if notes:
        print(f"trainfit: warning: report: {len(notes)} note(s) on the page (files or lines left out), "
              f"first: {notes[0]}", file=sys.stderr)
    if args.json:
        print(dumps_json({"report": str(path)}))
    else:
        print(f"report written to {path}", file=sys.stderr)
    return 0


def check_report_dir(run_dir) -> Path:
    """The run directory to read: an existing directory (refused, naming ``run_dir``, otherwise)."""
    root = Path(check_path_text("run_dir", run_dir))
    if root.exists() and not root.is_dir():
        raise ConfigError("run_dir", str(root), "a directory (this path is a file)")
    if not root.is_dir():
        raise ConfigError("run_dir", str(root), "an existing run directory", "run `trainfit train --run-dir DIR` first")
    return root


def report_target(root: Path, out, *, force: bool) -> Path:
    """Where the page goes: ``--out`` (a new file, or any file with ``force``), else ``RUN_DIR/report.html``.

    The default target is trainfit's own file: replaced when the directory carries trainfit's marker or the file
    is a page trainfit wrote; anything else there under that name is the user's and needs ``--force``.
    """
    if out is not None:
        check_write_target("--out", out)  # a named pipe would block the write: refused before any work
        return check_output_file("--out", out, force=force)
    path = root / REPORT
    if path.is_dir() or (path.exists() and not path.is_file()):
        raise ConfigError("--out", str(path), "a file path (RUN_DIR/report.html is not a file)",
                          "pass --out FILE.html")
    if path.exists() and not force and not owns(root) and not _is_trainfit_page(path):
        raise ConfigError("--out", str(path), "a path that does not exist yet (this report.html is not a page "
                          "trainfit wrote)", "pass --force to replace it, or --out FILE.html")
    return path


def _is_trainfit_page(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.read(len(PAGE_START.encode()))
    except OSError:
        return False
    return head == PAGE_START.encode()


def save_and_report(run_dir, name: str, doc, *, report: bool, keep_others: tuple[str, ...] = ()) -> None:
    """Store a command's JSON object as RUN_DIR/<name> (what the report reads); render when asked.

    With ``keep_others`` (e.g. the memory report's precision/checkpointing/strategy/batch), objects already in
    the file that differ in those keys are kept, so runs of several configurations make one bar each; a stored
    file that is not readable is replaced. The file is strict JSON (a non-finite number is null, named under
    ``"non_finite"`` in its object, which the report reads back) and written atomically.
    """
    root = claim_run_dir(run_dir)
    docs = [doc]
    if keep_others:
        key = tuple(doc.get(k) for k in keep_others)
        old = [d for d in read_docs(root / name, [])
               if isinstance(d, dict) and tuple(d.get(k) for k in keep_others) != key]
        docs = old + [doc]
    write_text_atomic(root / name, _dumps_docs(docs) if len(docs) > 1 else dumps_json(doc, indent=1))
    if report:
        run_report(root)


def _dumps_docs(docs: list) -> str:
    """A list of report objects as strict JSON, each object listing its own non-finite numbers."""
    return dumps_json([mark_non_finite(d) for d in docs], indent=1)


def run_report(run_dir) -> None:
    print(f"report written to {write_report(run_dir)}", file=sys.stderr)
