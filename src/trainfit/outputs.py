"""Where trainfit may write: the run directory it owns, and output files it will not clobber (pure: no torch).

Rules every command follows (issue: nothing of the user's is lost):

* A **run directory** is trainfit's when it holds the marker :data:`MARKER` (written when trainfit creates or
  first claims the directory). trainfit starts in a directory that does not exist, is empty, or carries the
  marker; it refuses any other directory, and a path that is a regular file, naming it.
* Inside its run directory trainfit replaces only files it wrote itself; the marker lists no names, because
  every file trainfit writes there has a fixed name (:data:`OWN_FILES`) or lives under ``checkpoints/``.
* An **output file** the user names (``--write``, ``--out``, ``--plot``, ``--trace``) must not exist unless
  ``--force`` is given; its parent must be a directory (or creatable). Commands check every output path
  *before* any work starts.
* Paths are text a person typed: control characters and bytes that are not UTF-8 are refused, since a TOML
  or JSON file that records the path could not hold it faithfully.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from trainfit.errors import ConfigError

MARKER = ".trainfit-run"
"""The file that marks a directory as a trainfit run directory."""

OWN_FILES = ("config.toml", "launch.toml", "metrics.jsonl", "memory.json", "profile.json", "plan.json",
             "verify.json", "report.html", MARKER, "checkpoints")
"""Names trainfit writes inside a run directory it owns."""


def check_path_text(field: str, path: str | os.PathLike) -> str:
    """Refuse control characters and non-UTF-8 bytes (surrogate escapes) in a path; return it as text."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError:
            raise ConfigError(field, repr(text), "a path of UTF-8 text") from None
    if not text.strip():
        raise ConfigError(field, text, "a non-empty path")
    for ch in text:
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            raise ConfigError(field, text, "a path without control characters (tab, newline, ...)")
        if 0xD800 <= ord(ch) <= 0xDFFF:
            raise ConfigError(field, text.encode("utf-8", "backslashreplace").decode(),
                              "a path of UTF-8 text (this one holds bytes that are not UTF-8)")
    return text


def owns(run_dir: str | os.PathLike) -> bool:
    """True when ``run_dir`` carries trainfit's marker."""
    return (Path(run_dir) / MARKER).is_file()


def check_run_dir(run_dir: str | os.PathLike, field: str = "run_dir") -> Path:
    """Refuse a run directory trainfit may not write into (without creating anything)."""
    p = Path(check_path_text(field, run_dir))
    if p.exists() and not p.is_dir():
        raise ConfigError(field, str(p), "a directory (this path is a file)", "choose another --run-dir")
    if p.is_dir() and not owns(p) and any(p.iterdir()):
        raise ConfigError(field, str(p), "a new or empty directory, or one trainfit created",
                          f"it holds files trainfit did not write and no {MARKER} marker; choose another --run-dir")
    _check_parent(field, p)
    return p


def claim_run_dir(run_dir: str | os.PathLike, field: str = "run_dir", *, checked: bool = False) -> Path:
    """Check (unless the caller has: ``checked``), then create the run directory and its marker."""
    p = Path(run_dir) if checked else check_run_dir(run_dir, field)
    p.mkdir(parents=True, exist_ok=True)
    marker = p / MARKER
    if not marker.exists():
        marker.write_text("This directory is a trainfit run directory: trainfit writes and replaces its own files "
                          "here (config.toml, metrics.jsonl, checkpoints/, *.json, report.html).\n")
    return p


def check_output_file(field: str, path: str | os.PathLike, *, force: bool = False, suffix: str = "") -> Path:
    """Refuse an output path that exists (unless ``force``), is a directory, or lies under a file."""
    p = Path(check_path_text(field, path))
    if suffix and p.suffix.lower() != suffix:
        raise ConfigError(field, str(p), f"a file name ending in {suffix}")
    if p.is_dir():
        raise ConfigError(field, str(p), "a file path (this is a directory)")
    if p.exists() and not force:
        raise ConfigError(field, str(p), "a path that does not exist yet", "pass --force to replace it")
    _check_parent(field, p)
    return p


def check_output_dir(field: str, path: str | os.PathLike, *, force: bool = False) -> Path:
    """An output directory (``--trace``): absent or empty, unless ``force``; never a file."""
    p = Path(check_path_text(field, path))
    if p.exists() and not p.is_dir():
        raise ConfigError(field, str(p), "a directory (this path is a file)")
    if p.is_dir() and any(p.iterdir()) and not force:
        raise ConfigError(field, str(p), "a new or empty directory", "pass --force to write into it")
    _check_parent(field, p)
    return p


def _check_parent(field: str, p: Path) -> None:
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(field, str(p), "a path whose parent is a directory", f"{parent} is a file")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ConfigError(field, str(p), "a path in a writable directory", f"cannot write in {parent}")
            return


def json_safe(obj: Any) -> tuple[Any, list[str]]:
    """``obj`` with every non-finite float replaced by None, and the dotted paths of the values replaced."""
    replaced: list[str] = []

    def walk(x: Any, where: str) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            replaced.append(f"{where}={x}")
            return None
        if isinstance(x, dict):
            return {k: walk(v, f"{where}.{k}" if where else str(k)) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(x)]
        return x

    return walk(obj, ""), replaced


def mark_non_finite(obj: Any) -> Any:
    """``obj`` made JSON-safe (:func:`json_safe`); a dict also lists what was replaced under ``"non_finite"``
    (e.g. ``["final_loss=nan"]``) so a reader knows why a value is missing."""
    safe, replaced = json_safe(obj)
    if replaced and isinstance(safe, dict):
        safe["non_finite"] = replaced
    return safe


def dumps_json(obj: Any, **kw: Any) -> str:
    """Strict JSON (no NaN/Infinity tokens) of :func:`mark_non_finite` ``(obj)``."""
    return json.dumps(mark_non_finite(obj), allow_nan=False, default=str, **kw)
