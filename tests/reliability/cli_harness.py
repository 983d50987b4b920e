"""Run the CLI in-process and check the promise every command makes about bad input.

The promise (README, "Bad input"): exit status 0 or 2; no traceback; stdout empty or exactly one
JSON object (strict JSON: no NaN/Infinity tokens); no file that existed before changed unless it is
trainfit's own (in a run directory trainfit created); a refused command leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

from trainfit.cli import main
from trainfit.outputs import MARKER


@dataclass
class Result:
    rc: int
    out: str
    err: str
    seconds: float = 0.0
    peak_bytes: int = 0
    """Python's peak traced allocation during the command (``traced=True``; 0 otherwise)."""


def cli(args: list[str], cwd: Path | None = None, *, traced: bool = False) -> Result:
    """``trainfit ARGS`` in this process (an uncaught exception propagates: that is a traceback). ``traced``: also
    measure its wall time and peak Python allocation (tracemalloc; the property tests bound both)."""
    out, err = io.StringIO(), io.StringIO()
    before = os.getcwd()
    if traced:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(args)
            except SystemExit as e:  # argparse's own refusals
                rc = e.code if isinstance(e.code, int) else 2
    finally:
        os.chdir(before)
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1] if traced else 0
        if traced:
            tracemalloc.stop()
    return Result(rc=int(rc or 0), out=out.getvalue(), err=err.getvalue(), seconds=seconds, peak_bytes=peak)


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (paths relative to it)."""
    found = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            found[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def _strict(token: str):
    raise ValueError(f"non-finite JSON token {token}")


def error_lines(err: str) -> list[str]:
    """stderr without the progress bar and warnings."""
    return [ln for ln in err.replace("\r", "\n").splitlines()
            if ln.strip() and "step/s" not in ln and "?step" not in ln and "%|" not in ln
            and not ln.startswith("trainfit: warning:") and not ln.startswith(("plan: measuring", "trainfit: plan: measuring", "report written"))]


def owned_by_trainfit(rel: str, root: Path) -> bool:
    """True when ``rel`` (relative to ``root``) lies in a directory carrying trainfit's marker."""
    p = (root / rel).parent
    while True:
        if (p / MARKER).is_file():
            return True
        if p == root or p == p.parent:
            return False
        p = p.parent


def check_promise(r: Result, root: Path, before: dict[str, str], *, json_mode: bool = False) -> None:
    """Assert the promise for a command run with files ``before`` under ``root`` (``json_mode``: with --json,
    stdout is empty or exactly one strict JSON object)."""
    assert "Traceback" not in r.err, r.err
    assert r.rc in (0, 2), (r.rc, r.err[-2000:])
    if r.rc == 2:
        assert not r.out.strip(), f"stdout of a refused command: {r.out[:200]}"
    if json_mode and r.out.strip():
        obj = json.loads(r.out, parse_constant=_strict)  # exactly one JSON document (raises on trailing text)
        assert isinstance(obj, dict), r.out[:200]
    after = snapshot(root)
    changed = [k for k, h in before.items() if after.get(k) != h and not owned_by_trainfit(k, root)]
    assert not changed, f"files the user owns were changed or removed: {changed}"
    if r.rc == 2:
        lines = [ln for ln in error_lines(r.err) if ln.startswith("trainfit: error:")]
        assert len(lines) == 1, r.err[-2000:]
        new = sorted(set(after) - set(before))
        assert not new, f"a refused command left files behind: {new} ({lines[0]})"


def check_one_line(r: Result) -> None:
    """A refused command's stderr is exactly one line, the error: no info line (``data: ...``), warning,
    progress bar or launcher banner before or after it."""
    if r.rc == 2:
        lines = [ln for ln in r.err.replace("\r", "\n").splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("trainfit: error: "), r.err[-3000:]
