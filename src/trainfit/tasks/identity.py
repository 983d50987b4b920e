"""What makes a run's data the same data: the identity a checkpoint records and a resume compares.

One plain dict per run (JSON and ``weights_only`` safe), one entry per field of :data:`FIELDS`:

* ``data`` / ``val_data``: the path (absolute) and a content fingerprint. A prepared directory is its sidecar's
  sha256 of ``tokens.bin`` and ``documents.bin`` (already verified when it is read); raw files are their paths,
  sizes and the sha256 of their first, middle and last :data:`SAMPLE_BYTES` (the whole file when smaller), so
  a corpus of any size is fingerprinted by reading at most 192 KiB per file. ``""`` when there is none (the
  generated data; no validation file).
* ``tokenizer``: its kind (``byte`` or ``tokenizer.json``) and the sha256 of tokenizer.json; the directory is kept
  for messages but not compared (a moved, identical tokenizer is the same tokenizer).
* ``packing``, ``text_field``, ``seq_len``, ``val_fraction``: the values themselves.

Pure (no torch): the training loop compares it before anything is built or written.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from trainfit.tasks.corpus import find_sources
from trainfit.tasks.prepared import DOCUMENTS, TOKENS, is_prepared, read_sidecar
from trainfit.tasks.spec import TOKENIZER_FILE, DataSpec
from trainfit.tasks.tokenizer import BYTE, sha256_file

FIELDS = ("data", "val_data", "tokenizer", "packing", "text_field", "seq_len", "val_fraction")
"""The data-identity fields, in the order a resume compares them (the first that differs is named)."""
SAMPLE_BYTES = 64 * 1024
"""Bytes hashed at the start, the middle and the end of each raw file."""

_CACHE: dict[tuple, dict[str, Any]] = {}
"""Fingerprints of this process, keyed by the paths, sizes and modification times they were made from."""


def data_identity(cfg) -> dict[str, Any]:
    """The identity of a RunConfig's data (``{"data": ""}`` for the task's generated data).

    Raises:
        ConfigError: naming the field whose files cannot be found or whose tokenizer cannot be read.
    """
    spec = DataSpec.from_config(cfg)
    if spec is None:
        return {"data": ""}
    return {"data": sources_identity(spec.data, field="data"),
            "val_data": sources_identity(spec.val_data, field="val_data") if spec.val_data else "",
            "tokenizer": tokenizer_identity(spec),
            "packing": spec.packing, "text_field": spec.text_field, "seq_len": spec.seq_len,
            "val_fraction": float(spec.val_fraction)}


def sources_identity(path: str, *, field: str) -> dict[str, Any]:
    """``path`` (absolute) and its content fingerprint: a prepared directory's checksums or raw files' samples."""
    where = os.path.abspath(os.path.expanduser(path))
    if is_prepared(path):
        files = read_sidecar(Path(path), field)["files"]
        sums = [str((files.get(name) or {}).get("sha256", "")) for name in (TOKENS, DOCUMENTS)]
        return {"path": where, "prepared": True, "sha256": hashlib.sha256(" ".join(sums).encode()).hexdigest()}
    stamps = tuple((s.path, s.size_bytes, os.stat(s.path).st_mtime_ns) for s in find_sources(path, field=field).files)
    key = ("sources", where, stamps)
    if key not in _CACHE:
        h = hashlib.sha256()
        for file, size, _ in stamps:
            h.update(json.dumps([os.path.abspath(file), size, sampled_sha256(Path(file), size)]).encode())
        _CACHE[key] = {"path": where, "files": len(stamps), "bytes": sum(s[1] for s in stamps),
                       "sha256": h.hexdigest()}
    return dict(_CACHE[key])


def sampled_sha256(path: Path, size: int) -> str:
    """sha256 of the file's first, middle and last :data:`SAMPLE_BYTES` (all of it when it holds fewer than 3x)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= 3 * SAMPLE_BYTES:
            h.update(f.read())
        else:
            for at in (0, (size - SAMPLE_BYTES) // 2, size - SAMPLE_BYTES):
                f.seek(at)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def tokenizer_identity(spec: DataSpec) -> dict[str, str]:
    """The tokenizer ``spec`` reads its data with: kind, sha256 of tokenizer.json, and where it is."""
    side = read_sidecar(Path(spec.data))["tokenizer"] if is_prepared(spec.data) else None
    if side is not None and spec.tokenizer in ("", str(side.get("name", BYTE))):
        name, sha = str(side.get("name", BYTE)), str(side.get("sha256", ""))  # its ids on disk: the sidecar's
    else:
        name = spec.tokenizer or BYTE
        file = Path(name) / TOKENIZER_FILE
        sha = sha256_file(file) if name != BYTE and file.is_file() else ""  # missing: the data load names it
    if not sha:
        return {"kind": BYTE, "name": BYTE, "sha256": ""}
    return {"kind": TOKENIZER_FILE, "name": os.path.abspath(name), "sha256": sha}


def same(field: str, old: Any, new: Any) -> bool:
    """Whether two values of ``field`` name the same data (a tokenizer by kind and checksum, not by place)."""
    if field == "tokenizer" and isinstance(old, dict) and isinstance(new, dict):
        return (old.get("kind"), old.get("sha256")) == (new.get("kind"), new.get("sha256"))
    return old == new


def describe(field: str, value: Any) -> str:
    """One short readable value for a message: the path and a prefix of the fingerprint."""
    if not isinstance(value, dict):
        return "'' (the generated data)" if field == "data" and value == "" else repr(value)
    if field == "tokenizer":
        sha = str(value.get("sha256", ""))
        return repr(BYTE) if not sha else f"{str(value.get('name'))[:120]!r} ({TOKENIZER_FILE} sha256 {sha[:12]})"
    what = "a prepared directory" if value.get("prepared") else \
        f"{value.get('files')} file(s), {int(value.get('bytes') or 0):,} bytes"
    return f"{str(value.get('path'))[:120]!r} ({what}, fingerprint {str(value.get('sha256'))[:12]})"
