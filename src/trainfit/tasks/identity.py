"""What makes a run's data the same data: the identity a checkpoint records and a resume compares.

One plain dict per run (JSON and ``weights_only`` safe), one entry per field of :data:`FIELDS`:

* ``data`` / ``val_data``: the path (absolute) and a content fingerprint. A prepared directory is its sidecar's
  sha256 of ``tokens.bin`` and ``documents.bin`` (already verified when it is read); raw files are the sha256 of
  every byte of every file (a streamed hash, :func:`trainfit.tasks.tokenizer.sha256_file`), with each file listed
  (path, size, sha256) when there are at most :data:`MAX_LISTED` of them, so that a refusal names the file that
  changed. ``""`` when there is none (the generated data; no validation file).
* ``tokenizer``: its kind (``byte`` or ``tokenizer.json``), the sha256 of tokenizer.json and of
  tokenizer_config.json (it names the end-of-document token); the directory is kept for messages but not compared
  (a moved, identical tokenizer is the same tokenizer).
* ``packing``, ``text_field``, ``seq_len``, ``val_fraction``: the values themselves.

A file's sha256 is cached in trainfit's cache directory (:func:`cache_dir`), keyed by its path, size, inode,
device, modification time and status-change time (``st_ctime_ns``), so a resume does not re-read unchanged data.
The status-change time is set by the kernel on every write and on every ``os.utime``: an edit that keeps the size
and puts the modification time back still changes it, so it misses the cache and is hashed. The limit: a file
changed while keeping its size, inode and both times -- possible only by setting the system clock back or writing
the disk raw -- would be taken from the cache; delete the cache directory to hash everything again. A file
changed within :data:`RACY_NS` of being hashed is never cached (a second edit in the same clock tick would keep
its times).

Pure (no torch): the training loop compares it before anything is built or written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from trainfit.errors import ConfigError
from trainfit.gate import RECORD, read_document
from trainfit.tasks.corpus import find_sources
from trainfit.tasks.prepared import DOCUMENTS, TOKENS, is_prepared, read_sidecar
from trainfit.tasks.spec import TOKENIZER_FILE, DataSpec
from trainfit.tasks.tokenizer import BYTE, sha256_file

FIELDS = ("data", "val_data", "tokenizer", "packing", "text_field", "seq_len", "val_fraction")
"""The data-identity fields, in the order a resume compares them (the first that differs is named)."""
SCHEME = "sha256-every-byte"
"""Marks a fingerprint of every byte (a record without it is older: first, middle and last 64 KiB sampled)."""
MAX_LISTED = 1000
"""Files listed one by one in an identity (path, size, sha256), so that a refusal names the one that changed."""
TOKENIZER_CONFIG = "tokenizer_config.json"
RACY_NS = 2 * 10**9
"""A file modified less than this before it is hashed is not cached (its times may not change on a next edit)."""
SAMPLE_BYTES = 64 * 1024
"""Bytes hashed at the start, the middle and the end of each raw file by the older, sampled fingerprint."""

_CACHE: dict[tuple, dict[str, Any]] = {}
"""Fingerprints of this process, keyed by the paths and stamps they were made from."""
_SHA = re.compile(r"[0-9a-f]{64}")


def cache_dir() -> Path:
    """Where file checksums are cached: ``$TRAINFIT_CACHE_DIR/identity`` or ``~/.cache/trainfit/identity``
    (``$XDG_CACHE_HOME`` honoured), the directory trainfit's planner caches in too."""
    root = os.environ.get("TRAINFIT_CACHE_DIR")
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainfit"
    return base / "identity"


def _stamp(info: os.stat_result) -> list[int]:
    return [info.st_size, info.st_ino, info.st_dev, info.st_mtime_ns, info.st_ctime_ns]


class _Sums:
    """The cached checksums of one group of files (a data path, a tokenizer directory): one JSON file of
    ``{path: [size, inode, device, mtime_ns, ctime_ns, sha256]}``, replaced whole (atomically) when it changes.
    Unreadable or unwritable, it is simply not used: every file is hashed."""

    def __init__(self, group: str) -> None:
        self.path = cache_dir() / f"{hashlib.sha256(group.encode()).hexdigest()[:32]}.json"
        self.entries: dict[str, list] = {}
        self.changed = False
        try:
            found = read_document(self.path, field="identity cache", fmt="json", limits=RECORD)
        except ConfigError:
            return
        if isinstance(found, dict):
            self.entries = {k: v for k, v in found.items() if isinstance(v, list) and len(v) == 6}

    def sha256(self, file: str) -> str:
        """sha256 of every byte of ``file``: from the cache when its stamp is the one cached, else read."""
        stamp = _stamp(os.stat(file))
        hit = self.entries.get(file)
        if hit is not None and hit[:5] == stamp and isinstance(hit[5], str) and _SHA.fullmatch(hit[5]):
            return hit[5]
        began = time.time_ns()
        sha = sha256_file(Path(file))  # every byte, streamed (1 MiB reads)
        if _stamp(os.stat(file)) == stamp and max(stamp[3], stamp[4]) < began - RACY_NS:
            self.entries[file], self.changed = [*stamp, sha], True
        return sha

    def save(self, keep: set[str]) -> None:
        """Write the entries of ``keep`` (the group's files now), when any was added or dropped."""
        entries = {k: v for k, v in self.entries.items() if k in keep}
        if not (self.changed or len(entries) != len(self.entries)):
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(entries, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a read-only home: no cache, still correct


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
    """``path`` (absolute) and its content fingerprint: a prepared directory's checksums, or every byte of the
    raw files (each listed when they are at most :data:`MAX_LISTED`)."""
    where = os.path.abspath(os.path.expanduser(path))
    if is_prepared(path):
        files = read_sidecar(Path(path), field)["files"]
        sums = [str((files.get(name) or {}).get("sha256", "")) for name in (TOKENS, DOCUMENTS)]
        return {"path": where, "prepared": True, "sha256": hashlib.sha256(" ".join(sums).encode()).hexdigest()}
    files = [os.path.abspath(s.path) for s in find_sources(path, field=field).files]
    key = ("sources", where, tuple((f, *_stamp(os.stat(f))) for f in files))
    if key not in _CACHE:
        sums = _Sums(where)
        listed = [[f, stamp[0], sums.sha256(f)] for f, *stamp in key[2]]
        sums.save(set(files))
        h = hashlib.sha256()
        for entry in listed:
            h.update(json.dumps(entry).encode())
        _CACHE[key] = {"path": where, "scheme": SCHEME, "files": len(listed), "bytes": sum(e[1] for e in listed),
                       "sha256": h.hexdigest(), **({"listed": listed} if len(listed) <= MAX_LISTED else {})}
    return json.loads(json.dumps(_CACHE[key]))  # a copy the caller may keep


def tokenizer_identity(spec: DataSpec) -> dict[str, str]:
    """The tokenizer ``spec`` reads its data with: kind, sha256 of tokenizer.json and of tokenizer_config.json
    ("" when absent), and where it is."""
    side = read_sidecar(Path(spec.data))["tokenizer"] if is_prepared(spec.data) else None
    if side is not None and spec.tokenizer in ("", str(side.get("name", BYTE))):
        name, sha = str(side.get("name", BYTE)), str(side.get("sha256", ""))  # its ids on disk: the sidecar's
        config = ""
    else:
        name = spec.tokenizer or BYTE
        file, config_file = Path(name) / TOKENIZER_FILE, Path(name) / TOKENIZER_CONFIG
        sums = _Sums(os.path.abspath(name)) if name != BYTE else None
        sha = sums.sha256(str(file.absolute())) if sums and file.is_file() else ""  # missing: the load names it
        config = sums.sha256(str(config_file.absolute())) if sums and config_file.is_file() else ""
        if sums:
            sums.save({str(file.absolute()), str(config_file.absolute())})
    if not sha:
        return {"kind": BYTE, "name": BYTE, "sha256": ""}
    return {"kind": TOKENIZER_FILE, "name": os.path.abspath(name), "sha256": sha, "config_sha256": config}


def same(field: str, old: Any, new: Any) -> bool:
    """Whether two values of ``field`` name the same data (a tokenizer by kind and checksums, not by place; a
    fingerprint recorded by an older trainfit compared with the same, sampled, fingerprint of the data now)."""
    if field == "tokenizer" and isinstance(old, dict) and isinstance(new, dict):
        keys = ("kind", "sha256", "config_sha256") if "config_sha256" in old else ("kind", "sha256")
        return all(old.get(k) == new.get(k) for k in keys)
    if isinstance(old, dict) and isinstance(new, dict) and new.get("scheme") and not old.get("prepared") \
            and "scheme" not in old:
        return old == _sampled_identity(new, field)
    return old == new


def _sampled_identity(new: dict[str, Any], field: str) -> dict[str, Any]:
    """The older identity (first, middle and last :data:`SAMPLE_BYTES` of each file) of the files ``new`` read."""
    files = [(os.path.abspath(s.path), s.size_bytes) for s in find_sources(str(new["path"]), field=field).files]
    h = hashlib.sha256()
    for file, size in files:
        h.update(json.dumps([file, size, _sampled_sha256(Path(file), size)]).encode())
    return {"path": new["path"], "files": len(files), "bytes": sum(s for _, s in files), "sha256": h.hexdigest()}


def _sampled_sha256(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= 3 * SAMPLE_BYTES:
            h.update(f.read())
        else:
            for at in (0, (size - SAMPLE_BYTES) // 2, size - SAMPLE_BYTES):
                f.seek(at)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def difference(field: str, old: Any, new: Any) -> str:
    """The file that makes two values of ``field`` differ, for a message ("" when the identities do not say)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return ""
    if field == "tokenizer":
        for key, file in (("sha256", TOKENIZER_FILE), ("config_sha256", TOKENIZER_CONFIG)):
            if key in old and old.get(key) != new.get(key):
                return f"{_cut(os.path.join(str(new.get('name', '')), file))} differs from the one recorded"
        return ""
    try:
        was = {str(f): (size, sha) for f, size, sha in old.get("listed") or ()}
        now = {str(f): (size, sha) for f, size, sha in new.get("listed") or ()}
    except (TypeError, ValueError):  # a record edited by hand
        return ""
    for file in sorted(set(was) | set(now)) if was and now else ():
        if file not in now or file not in was:
            return f"{_cut(file)} {'is gone' if file not in now else 'was not there'}"
        if was[file] != now[file]:
            return (f"{_cut(file)} changed ({was[file][0]:,} bytes sha256 {str(was[file][1])[:12]} then, "
                    f"{now[file][0]:,} bytes sha256 {now[file][1][:12]} now)")
    return ""


def _cut(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


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
