"""The token file ``trainfit prepare`` writes, and reading it back (memory-mapped, checked).

A prepared directory holds three files:

* ``tokens.bin``: every kept document's tokens followed by its end-of-document id, back to back, little-endian
  ``uint16`` when the vocabulary fits (<= 65,535 ids), else ``uint32``. Packing at load time reads it as one
  stream; padding reads one document at a time. Either way one slice of the memory map per row.
* ``documents.bin``: little-endian ``uint64`` start offsets of the documents in ``tokens.bin``, n_documents + 1
  (the last is n_tokens).
* ``prepared.json``: the sidecar -- format and version, tokenizer (``byte`` or its directory and the sha256 of
  its tokenizer.json), vocab_size, eod_id, dtype, n_tokens, n_documents, skipped documents, byte size and
  sha256 of both files, the sources read (paths and sizes) and the text field.

Writing streams (a batch of documents at a time, appended to the files), is deterministic (same inputs ->
byte-identical files: no time stamps, sorted keys) and atomic: everything goes to ``DIR.tmp-<pid>`` first and
is renamed into place at the end, so a failed or killed prepare leaves no ``DIR``. Reading verifies the sidecar,
both sizes and both checksums before a row is served.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from trainfit.errors import ConfigError
from trainfit.tasks.corpus import Sources
from trainfit.tasks.tokenizer import TextTokenizer

FORMAT = "trainfit-tokens"
VERSION = 1
SIDECAR, TOKENS, DOCUMENTS = "prepared.json", "tokens.bin", "documents.bin"
KEYS = ("format", "version", "tokenizer", "vocab_size", "eod_id", "dtype", "n_tokens", "n_documents",
        "skipped_documents", "files", "sources", "text_field")
"""Keys every sidecar holds."""
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
OFFSET_DTYPE = np.dtype("<u8")
BATCH_DOCS = 256
"""Documents tokenized and appended per write (bounds the memory of a prepare)."""
MIN_DOC_TOKENS = 2
"""A document (its tokens + end-of-document) shorter than this gives no label and is skipped."""


def is_prepared(path: str | os.PathLike) -> bool:
    return (Path(path) / SIDECAR).is_file()


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65_535 else "uint32"


@dataclass
class TokenStore:
    """Documents as one token array plus start offsets: a prepared directory (memory-mapped lazily, once per
    process, so DataLoader workers forked after loading open their own map) or tokens held in memory."""

    offsets: np.ndarray
    """int64, n_documents + 1."""
    path: str = ""
    """tokens.bin of a prepared directory ("" when in memory)."""
    dtype: str = "uint16"
    array: np.ndarray | None = field(default=None, repr=False)
    _pid: int = field(default=-1, repr=False)

    @property
    def n_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def tokens(self) -> np.ndarray:
        if self.path and (self.array is None or self._pid != os.getpid()):
            n = self.n_tokens
            self.array = np.memmap(self.path, dtype=DTYPES[self.dtype], mode="r", shape=(n,)) if n else \
                np.zeros(0, DTYPES[self.dtype])
            self._pid = os.getpid()
        return self.array

    def __getstate__(self) -> dict[str, Any]:  # a spawned worker reopens the map instead of copying it
        state = dict(self.__dict__)
        if self.path:
            state["array"], state["_pid"] = None, -1
        return state


def tokenize_documents(texts: Iterable[str], tokenizer: TextTokenizer, *, progress: bool = False,
                       desc: str = "tokenizing", threads: bool = True) -> Iterable[tuple[np.ndarray | None, int]]:
    """Each document's tokens with its end-of-document id appended (None for one too short to give a label),
    tokenized a batch at a time; with ``progress`` a tqdm bar on stderr counts documents. ``threads=False``: one
    document at a time, for a process that forks DataLoader workers later (the tokenizers library disables its
    thread pool in a child forked after using it, and says so on stderr in several lines)."""
    bar = tqdm(unit="doc", desc=desc, file=sys.stderr, disable=not progress, dynamic_ncols=True)
    batch: list[str] = []

    def flush():
        for ids in (tokenizer.encode_many(batch) if threads else map(tokenizer.encode, batch)):
            yield (np.append(ids, tokenizer.eod_id) if len(ids) + 1 >= MIN_DOC_TOKENS else None), len(ids)
        bar.update(len(batch))
        batch.clear()

    try:
        for text in texts:
            batch.append(text)
            if len(batch) >= BATCH_DOCS:
                yield from flush()
        yield from flush()
    finally:
        bar.close()


class _HashedFile:
    def __init__(self, path: Path) -> None:
        self.f, self.h, self.n = open(path, "wb"), hashlib.sha256(), 0

    def write(self, data: bytes) -> None:
        self.f.write(data)
        self.h.update(data)
        self.n += len(data)


def write_prepared(out: Path, *, texts: Iterable[str], tokenizer: TextTokenizer, sources: Sources, text_field: str,
                   data: str, progress: bool = False) -> dict[str, Any]:
    """Tokenize ``texts`` into ``out`` (a new or empty directory, or one the caller was told to overwrite).

    Returns:
        The sidecar written.
    Raises:
        ConfigError: naming ``data`` when no document gives a label (nothing is left behind).
    """
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dtype = DTYPES[token_dtype(tokenizer.vocab_size)]
    try:
        tokens, docs = _HashedFile(tmp / TOKENS), _HashedFile(tmp / DOCUMENTS)
        with tokens.f, docs.f:
            n_tokens, n_docs, skipped = 0, 0, 0
            docs.write(np.zeros(1, OFFSET_DTYPE).tobytes())
            for ids, _ in tokenize_documents(texts, tokenizer, progress=progress, desc="prepare"):
                if ids is None:
                    skipped += 1
                    continue
                tokens.write(ids.astype(dtype).tobytes())
                n_tokens, n_docs = n_tokens + len(ids), n_docs + 1
                docs.write(np.array([n_tokens], OFFSET_DTYPE).tobytes())
        if n_docs == 0:
            raise ConfigError("data", data, "data holding at least one non-empty document",
                              f"all {skipped} document(s) are empty")
        sidecar = {
            "format": FORMAT, "version": VERSION,
            "tokenizer": {"name": tokenizer.name if not tokenizer.sha256 else str(Path(tokenizer.name).resolve()),
                          "sha256": tokenizer.sha256},  # a directory as an absolute path: train runs from anywhere
            "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id, "dtype": token_dtype(tokenizer.vocab_size),
            "n_tokens": n_tokens, "n_documents": n_docs, "skipped_documents": skipped,
            "files": {TOKENS: {"bytes": tokens.n, "sha256": tokens.h.hexdigest()},
                      DOCUMENTS: {"bytes": docs.n, "sha256": docs.h.hexdigest()}},
            "sources": [{"path": s.path, "size_bytes": s.size_bytes} for s in sources.files],
            "text_field": text_field,
        }
        (tmp / SIDECAR).write_text(json.dumps(sidecar, indent=1, sort_keys=True) + "\n")
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sidecar


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; into an existing (forced) directory the sidecar goes last, after the old one
    is removed, so no moment shows a sidecar next to files it does not describe."""
    if not out.exists():
        os.rename(tmp, out)
        return
    (out / SIDECAR).unlink(missing_ok=True)
    for name in (TOKENS, DOCUMENTS, SIDECAR):
        os.replace(tmp / name, out / name)
    tmp.rmdir()


def _bad(field: str, directory: Path, what: str) -> ConfigError:
    return ConfigError(field, str(directory), "a directory written by `trainfit prepare`",
                       f"{what}; re-run trainfit prepare")


def read_sidecar(directory: Path, field: str = "data") -> dict[str, Any]:
    """The sidecar of ``directory``, its keys and values checked (not yet the files)."""
    path = directory / SIDECAR
    try:
        side = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise _bad(field, directory, f"{path} is not readable JSON ({type(e).__name__})") from None
    if not isinstance(side, dict) or side.get("format") != FORMAT:
        raise _bad(field, directory, f"{path} is not a {FORMAT} sidecar")
    missing = [k for k in KEYS if k not in side]
    if missing:
        raise _bad(field, directory, f"{path} lacks {', '.join(missing)}")
    if side["version"] != VERSION:
        raise _bad(field, directory, f"{path} is format version {side['version']!r}; this trainfit reads {VERSION}")
    ints = ("vocab_size", "eod_id", "n_tokens", "n_documents")
    if side["dtype"] not in DTYPES or not all(isinstance(side[k], int) and side[k] >= 0 for k in ints) or \
            not isinstance(side["files"], dict) or not isinstance(side["tokenizer"], dict):
        raise _bad(field, directory, f"{path} holds a value of the wrong type")
    return side


def open_prepared(directory: Path, field: str = "data") -> tuple[TokenStore, dict[str, Any]]:
    """A prepared directory's documents, after checking the sidecar, both file sizes and both sha256 checksums.

    Raises:
        ConfigError: naming ``field`` and the file that does not match ("re-run trainfit prepare").
    """
    side = read_sidecar(directory, field)
    sizes = {TOKENS: side["n_tokens"] * DTYPES[side["dtype"]].itemsize, DOCUMENTS: (side["n_documents"] + 1) * 8}
    for name, size in sizes.items():
        path, entry = directory / name, side["files"].get(name)
        if not isinstance(entry, dict) or not path.is_file():
            raise _bad(field, directory, f"{path} is missing")
        if path.stat().st_size != size or entry.get("bytes") != size:
            raise _bad(field, directory, f"{path} holds {path.stat().st_size:,} bytes, the sidecar says {size:,}")
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        if h.hexdigest() != entry.get("sha256"):
            raise _bad(field, directory, f"{path}'s sha256 does not match prepared.json (changed since prepare)")
    offsets = np.fromfile(directory / DOCUMENTS, dtype=OFFSET_DTYPE).astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != side["n_tokens"] or np.any(np.diff(offsets) < MIN_DOC_TOKENS):
        raise _bad(field, directory, f"{directory / DOCUMENTS} holds offsets that do not describe {TOKENS}")
    return TokenStore(offsets=offsets, path=str(directory / TOKENS), dtype=side["dtype"]), side
