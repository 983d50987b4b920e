"""The token file ``trainfit prepare`` writes, and reading it back (memory-mapped, checked).

A prepared directory holds three files:

* ``tokens.bin``: every kept document's tokens followed by its end-of-document id, back to back, little-endian
  ``uint16`` when the vocabulary fits (<= 65,535 ids), else ``uint32``. Packing at load time reads it as one
  stream; padding reads one document at a time. Either way one slice of the memory map per row.
* ``documents.bin``: little-endian ``uint64`` start offsets of the documents in ``tokens.bin``, n_documents + 1
  (the last is n_tokens).
* ``prepared.json``: the sidecar -- format and version, tokenizer (``byte`` or its directory and the sha256 of
  its tokenizer.json), vocab_size, eod_id, dtype, n_tokens, n_documents, skipped documents, max_id (the largest
  id in tokens.bin), byte size and sha256 of both files, the sources read (paths and sizes) and the text field.

Writing streams in bounded memory whatever the document sizes: units of at most :data:`UNIT_CHARS` characters
(a long document is cut where its tokenizer gives the same ids apart as together), one per CPU per call, their ids
appended in the file's dtype as they come. It is deterministic (same inputs -> byte-identical files: no time
stamps, sorted keys) and atomic: everything goes to ``DIR.tmp-<pid>`` first and is renamed into place at the end,
so a failed or interrupted prepare (Ctrl-C, SIGTERM) leaves no ``DIR`` and no ``DIR.tmp-<pid>``. That directory
holds a marker (:data:`TEMPORARY_MARKER`: pid, process start time, boot id); a killed prepare's marked directory
is removed by the next (:func:`clean_stale`), and nothing without a valid marker of an ended process ever is.
Reading checks every sidecar field against the others, the tokenizer and the files (sizes, checksums, the largest
id, every document's EOD) before a row is served (:func:`open_prepared`).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from trainfit.errors import ConfigError, TrainfitError
from trainfit.gate import RECORD, Limits, parse_int, read_document
from trainfit.tasks.corpus import Sources
from trainfit.tasks.tokenizer import BYTE, TextTokenizer, load_tokenizer, sha256_file

FORMAT = "trainfit-tokens"
VERSION = 2
"""2: the sidecar holds max_id (version 1 directories are refused: re-run trainfit prepare)."""
SIDECAR, TOKENS, DOCUMENTS = "prepared.json", "tokens.bin", "documents.bin"
KEYS = ("format", "version", "tokenizer", "vocab_size", "eod_id", "dtype", "n_tokens", "n_documents",
        "skipped_documents", "max_id", "files", "sources", "text_field")
"""Keys every sidecar holds."""
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
OFFSET_DTYPE = np.dtype("<u8")
BATCH_DOCS = 256
"""Most units (documents or parts of one) tokenized per call (:func:`tokenize_documents`: documents per call)."""
UNIT_CHARS = 1 << 15
"""Characters tokenized per call at most, whatever the documents' sizes (32 Ki: a BPE call stays well under a
second, so Ctrl-C is answered within one); a longer document is tokenized in parts cut by :func:`_cut`."""
BATCH_CHARS = UNIT_CHARS * (os.cpu_count() or 1)
"""Characters per batch: one unit per CPU, which a Hugging Face tokenizer encodes on its threads side by side."""
CUT_WINDOW = 128
"""Characters either side of a cut that must encode apart as together (Hugging Face tokenizers)."""
CUT_TRIES = 16
"""Pre-token boundaries tried as cuts per unit (latest first) before looking further."""
SCAN_CHARS = 4 * CUT_WINDOW
"""Characters before a unit's end searched for a pre-token boundary to cut at."""
MAX_UNIT_BYTES = 1 << 20
"""The most UTF-8 bytes ever tokenized in one call (1 MiB): text that its tokenizer cannot cut more finely (one
pre-token of a million letters; a tokenizer with no pre-tokenizer) is refused past it, so a worker's memory stays
bounded whatever the document. In bytes, not characters: a BPE's memory grows with the bytes (~210 per byte
measured: 1,000,000 x 'a' peaked at 255 MB, 1,000,000 x U+00A1 at 491 MB)."""
MEMORY_PER_WORKER_MB = 400
"""The stated bound on one prepare process's peak memory, whatever the document: start-up (~40 MB, ~75 MB with a
BPE loaded), a unit of :data:`UNIT_CHARS` per CPU (~300 bytes per character under a BPE tokenizer: ~10 MB each),
and at worst one uncut unit of :data:`MAX_UNIT_BYTES` (~210 MB).
Measured flat at 77-81 MB for whitespace-free documents of 1 to 200 MB under BPE, 39-40 MB under bytes
(``benchmarks/results/prepare_memory_blob.md``; the code before: 1,090 MB for 4 MB)."""
OFFSETS_PER_WRITE = 1 << 16
"""Document end offsets buffered per write of documents.bin."""
READ_CHUNK = 1 << 20
"""Bytes hashed (and scanned for the largest id) per read when checking a prepared directory."""
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

    def encode(texts: list[str]) -> Iterable[np.ndarray]:
        if threads and all(len(t) <= UNIT_CHARS for t in texts):
            return tokenizer.encode_many(texts)
        return map(lambda t: encode_bounded(t, tokenizer), texts)  # noqa: C417 - lazily, one document at a time

    def flush():
        for ids in encode(batch):
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


def encode_bounded(text: str, tokenizer: TextTokenizer) -> np.ndarray:
    """``tokenizer.encode(text)``, a unit of about :data:`UNIT_CHARS` characters at a time when ``text`` is longer
    (cut where apart encodes as together: :func:`_units`), so the tokenizer's own memory stays bounded whatever the
    document; the ids are the same."""
    if tokenizer.backend is None or len(text) <= UNIT_CHARS:
        return tokenizer.encode(text)
    return np.concatenate([tokenizer.encode(unit) for unit, _ in _units([(text, True)], tokenizer)])


class _HashedFile:
    def __init__(self, path: Path) -> None:
        self.f, self.h, self.n = open(path, "wb"), hashlib.sha256(), 0

    def write(self, data: bytes) -> None:
        self.f.write(data)
        self.h.update(data)
        self.n += len(data)


def _alike(backend: Any, text: str, i: int) -> bool:
    """True when ``text`` cut at ``i`` encodes as the two sides' encodings joined, over a window of
    :data:`CUT_WINDOW` characters either side (the pre-tokenizer and merges are local)."""
    a, b = text[max(0, i - CUT_WINDOW):i], text[i:i + CUT_WINDOW]
    ids = lambda t: backend.encode(t, add_special_tokens=False).ids  # noqa: E731
    return ids(a + b) == ids(a) + ids(b)


def _boundaries(backend: Any, text: str, lo: int, hi: int) -> list[int]:
    """Where the tokenizer's own pre-tokenizer splits ``text[lo:hi]`` between two pre-tokens that both lie inside
    it (the first and the last may be cut short by the window), latest first, as indices of ``text``.

    The model (BPE, WordPiece, Unigram) encodes each pre-token apart: no merge crosses such a split, so a cut
    there keeps the ids of the whole document (checked again by :func:`_alike`)."""
    spans = backend.pre_tokenizer.pre_tokenize_str(text[lo:hi])
    return [lo + a for _, (a, _b) in reversed(spans[2:-1])]


def _cut(tokenizer: TextTokenizer, text: str, start: int, end: int) -> int:
    """The latest index in (start, end] where ``text`` tokenizes apart as together; 0 when none is found.

    Bytes cut anywhere. A Hugging Face tokenizer is cut between two of its pre-tokens in the last
    :data:`SCAN_CHARS` before ``end`` (a run with no whitespace -- a base64 blob -- splits there too: at a
    letter/digit/punctuation change for byte-level BPE), each cut tried against the tokenizer (:func:`_alike`)
    before it is taken. One with no pre-tokenizer is never cut: its model merges across the whole text (spaces
    included), so no local test proves a cut exact (cuts after whitespace, tried over 128 characters either side,
    changed the ids of such a BPE); its documents are bounded by :data:`MAX_UNIT_BYTES` instead."""
    backend = tokenizer.backend
    if backend is None:
        return end
    if backend.pre_tokenizer is None:
        return 0
    lo = max(start + 1, end - SCAN_CHARS)
    inside = [i for i in _boundaries(backend, text, lo, min(len(text), end + CUT_WINDOW)) if start < i <= end]
    return next((i for i in inside[:CUT_TRIES] if _alike(backend, text, i)), 0)


def _too_long(tokenizer: TextTokenizer, held: str) -> ConfigError | None:
    """The refusal of ``held``, text no cut was found in, when it is past :data:`MAX_UNIT_BYTES` (else None)."""
    if len(held) * 4 <= MAX_UNIT_BYTES or len(held.encode("utf-8", "surrogatepass")) <= MAX_UNIT_BYTES:
        return None
    return ConfigError("data", f"a document with {len(held):,}+ characters in a row", "documents the tokenizer can "
                       f"cut into parts of at most {MAX_UNIT_BYTES:,} UTF-8 bytes (bounded memory)",
                       f"tokenizer {tokenizer.name} gives no place in them where encoding apart equals encoding "
                       "together (one pre-token that long, or no pre-tokenizer at all); split the document")


def _units(pieces: Iterable[tuple[str, bool]], tokenizer: TextTokenizer) -> Iterator[tuple[str, bool]]:
    """``(text, ends_document)`` of at most about :data:`UNIT_CHARS` characters each, cut where tokenizing them
    apart gives the same ids as the whole document (a text with no such cut is held until one comes or the
    document ends, up to :data:`MAX_UNIT_BYTES`: past that it is refused, never tokenized in unbounded memory)."""
    ahead = 0 if tokenizer.backend is None else CUT_WINDOW  # a cut needs the text after it
    carry, end = "", UNIT_CHARS
    for text, last in pieces:
        buf, carry, start = carry + text if carry else text, "", 0
        while end <= len(buf) - ahead * (not last) and len(buf) - start > UNIT_CHARS:
            cut = _cut(tokenizer, buf, start, end)
            if cut:
                yield buf[start:cut], False
                start, end = cut, cut + UNIT_CHARS
            else:
                end += UNIT_CHARS  # no cut here: look further (a longer unit)
        refused = _too_long(tokenizer, buf[start:]) if len(buf) - start > UNIT_CHARS else None
        if refused:
            raise refused
        if last:
            yield buf[start:], True
            end = UNIT_CHARS
        else:
            carry, end = buf[start:], max(end - start, UNIT_CHARS)  # resume the search where it stopped


def _encode(texts: list[str], tokenizer: TextTokenizer, dtype: np.dtype) -> list[np.ndarray]:
    """Each text's ids in ``dtype`` (no int64 copy); an id outside the vocabulary is refused."""
    if tokenizer.backend is None:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(dtype) for t in texts]
    out = []
    for e in tokenizer.backend.encode_batch(texts, add_special_tokens=False):
        top = max(e.ids, default=-1)  # before the cast: numpy < 2 wraps an id too large for the dtype
        if top >= tokenizer.vocab_size:
            raise ConfigError("tokenizer", tokenizer.name, f"a tokenizer whose ids are below its vocabulary size "
                              f"({tokenizer.vocab_size:,})", f"it produced id {top:,}")
        out.append(np.array(e.ids, dtype=dtype))
    return out


def stream_ids(pieces: Iterable[tuple[str, bool]], tokenizer: TextTokenizer, dtype: np.dtype
               ) -> Iterator[tuple[np.ndarray, bool]]:
    """``(ids, ends_document)`` of the ``(text, ends_document)`` pieces, in ``dtype``, a bounded batch of units at
    a time (:data:`BATCH_CHARS` characters or :data:`BATCH_DOCS` units); the end-of-document id is not added."""
    batch: list[tuple[str, bool]] = []
    chars = 0
    for unit in _units(pieces, tokenizer):
        batch.append(unit)
        chars += len(unit[0])
        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
            yield from zip(_encode([t for t, _ in batch], tokenizer, dtype), (e for _, e in batch))
            batch, chars = [], 0
    if batch:
        yield from zip(_encode([t for t, _ in batch], tokenizer, dtype), (e for _, e in batch))


@dataclass
class _Written:
    """What :func:`_write_tokens` wrote."""

    n_tokens: int = 0
    n_documents: int = 0
    skipped: int = 0
    max_id: int = 0


def _write_tokens(pieces: Iterable[tuple[str, bool]], tokenizer: TextTokenizer, tokens: _HashedFile,
                  docs: _HashedFile, bar: tqdm) -> _Written:
    """Append each document's ids + EOD to ``tokens`` and its end offset to ``docs`` as they are produced."""
    dtype = DTYPES[token_dtype(tokenizer.vocab_size)]
    w, in_doc, ends = _Written(), 0, [0]
    eod = np.array([tokenizer.eod_id], dtype=dtype)
    for ids, last in stream_ids(pieces, tokenizer, dtype):
        for part in (ids, eod) if last and in_doc + len(ids) + 1 >= MIN_DOC_TOKENS else (ids,):
            if len(part):
                tokens.write(part.tobytes())
                w.max_id = max(w.max_id, int(part.max()))
        in_doc += len(ids)
        bar.update(len(ids))
        if last:
            if in_doc + 1 >= MIN_DOC_TOKENS:
                w.n_tokens, w.n_documents = w.n_tokens + in_doc + 1, w.n_documents + 1
                ends.append(w.n_tokens)
            else:
                w.skipped += 1
            in_doc = 0
        if len(ends) >= OFFSETS_PER_WRITE:
            docs.write(np.array(ends, OFFSET_DTYPE).tobytes())
            ends = []
    docs.write(np.array(ends, OFFSET_DTYPE).tobytes())
    return w


TEMPORARY_MARKER = ".trainfit-prepare"
"""The file inside ``OUT.tmp-<pid>`` that says trainfit made it: which process (pid, start time, boot)."""
MARKER_FORMAT = "trainfit-prepare-temporary"
_MARKER_LIMITS = Limits(max_bytes=4096, max_depth=2, max_items=16)
OWN_NAMES = (TOKENS, DOCUMENTS, SIDECAR, TEMPORARY_MARKER)
"""All a temporary directory of prepare ever holds: one holding anything else is not removed."""


class OutOfMemory(TrainfitError):
    """Python ran out of memory while prepare was writing: its temporary directory is removed."""


class Terminated(TrainfitError):
    """SIGTERM arrived while prepare was writing: its temporary directory is removed, nothing else was written."""


def _proc(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(4096)
    except OSError:
        return ""


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc/PID/stat`` field 22), None when it does not
    run or this system has no ``/proc``: with the pid, it names one process, so a reused pid is told apart."""
    stat = _proc(f"/proc/{pid}/stat")
    fields = stat.rpartition(")")[2].split()  # the command name in (...) may hold spaces
    if len(fields) < 20:
        return None
    try:
        return parse_int("starttime", fields[19], minimum=0)
    except ConfigError:
        return None


def _boot() -> str:
    return _proc("/proc/sys/kernel/random/boot_id").strip()


def _owner_gone(marker: dict[str, Any]) -> bool:
    """Whether the process that wrote ``marker`` has ended (its pid runs no more, or runs another process)."""
    if marker["boot"] and _boot() and marker["boot"] != _boot():
        return True  # written before this machine last started
    if marker["start"] is None or process_start(os.getpid()) is None:  # no start times here: the pid alone
        return not _running(marker["pid"])
    return process_start(marker["pid"]) != marker["start"]


def _read_marker(tmp: Path) -> dict[str, Any] | None:
    """The marker of ``tmp`` when it is a valid one, else None (then trainfit did not make ``tmp``)."""
    path = tmp / TEMPORARY_MARKER
    if path.is_symlink() or not path.is_file():
        return None
    try:
        marker = read_document(path, field="marker", fmt="json", limits=_MARKER_LIMITS)
    except ConfigError:
        return None
    ok = (isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT and _count(marker.get("pid"))
          and marker["pid"] > 0 and (marker.get("start") is None or _count(marker.get("start")))
          and isinstance(marker.get("boot"), str))
    return marker if ok else None


def _remove_own(tmp: Path) -> bool:
    """Remove ``tmp`` when it holds nothing but what prepare writes (the marker last); True when it is gone."""
    try:
        names = os.listdir(tmp)
        if not set(names) <= set(OWN_NAMES) or any((tmp / n).is_dir() and not (tmp / n).is_symlink()
                                                   for n in names):
            return False
        for name in sorted(names, key=lambda n: n == TEMPORARY_MARKER):
            (tmp / name).unlink(missing_ok=True)
        tmp.rmdir()
    except OSError:
        return False
    return True


def clean_stale(out: Path) -> list[str]:
    """Remove the temporary directories beside ``out`` that a prepare made and marked and could not remove itself
    (killed: SIGKILL, out of memory), judged by their marker alone, never by name: a directory without a valid
    :data:`TEMPORARY_MARKER`, one whose process still runs (pid and start time), or one holding anything prepare
    does not write is left as it is.

    Returns:
        The names removed.
    """
    removed = []
    for tmp in sorted(out.parent.glob(f"{glob.escape(out.name)}.tmp-*")):
        if tmp.is_symlink() or not tmp.is_dir():
            continue
        marker = _read_marker(tmp)
        if marker is not None and _owner_gone(marker) and _remove_own(tmp):
            removed.append(tmp.name)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process (or not ours to judge)
    return True


def make_temporary(out: Path) -> Path:
    """A new directory ``OUT.tmp-<pid>`` (``OUT.tmp-<pid>-<n>`` when that name is taken: never reused) holding
    the marker that lets a later prepare remove it once this process has ended."""
    pid = os.getpid()
    marker = json.dumps({"format": MARKER_FORMAT, "pid": pid, "start": process_start(pid), "boot": _boot()})
    for n in range(1000):
        tmp = out.parent / (f"{out.name}.tmp-{pid}" + (f"-{n}" if n else ""))
        try:
            tmp.mkdir(parents=True)
        except FileExistsError:
            continue
        try:
            (tmp / TEMPORARY_MARKER).write_text(marker + "\n")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # just made by this exclusive mkdir
            raise
        return tmp
    raise ConfigError("--out", str(out), "a directory whose parent can hold a temporary directory",
                      f"{out.name}.tmp-{pid} and 999 more names beside it are taken")


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` inside the block (in the main thread), so the block's cleanup runs as
    for Ctrl-C; the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        raise Terminated("prepare: terminated (SIGTERM); its temporary directory was removed and --out was not "
                         "written")

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def write_prepared(out: Path, *, pieces: Iterable[tuple[str, bool]], tokenizer: TextTokenizer, sources: Sources,
                   text_field: str, data: str, progress: bool = False) -> dict[str, Any]:
    """Tokenize the documents of ``pieces`` (:func:`trainfit.tasks.corpus.read_pieces`) into ``out`` (a new or
    empty directory, or one the caller was told to overwrite), in bounded memory: a unit of
    :data:`UNIT_CHARS` characters at a time, ids written in the file's dtype as they are produced.

    Returns:
        The sidecar written.
    Raises:
        ConfigError: naming ``data`` when no document gives a label (nothing is left behind). On any exception,
            Ctrl-C included, ``OUT.tmp-<pid>`` is removed.
        Terminated: SIGTERM arrived (in the main thread); ``OUT.tmp-<pid>`` is removed.
        OutOfMemory: a ``MemoryError``; ``OUT.tmp-<pid>`` is removed.
    """
    with _sigterm_raises():
        tmp = make_temporary(out)
        try:
            return _write_into(tmp, out, pieces=pieces, tokenizer=tokenizer, sources=sources,
                               text_field=text_field, data=data, progress=progress)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)  # made by this call (an exclusive mkdir): all of it is ours
            if isinstance(e, MemoryError):
                raise OutOfMemory(f"prepare ran out of memory writing {out}; its temporary directory was removed "
                                  f"and --out was not written (each worker needs about {MEMORY_PER_WORKER_MB} "
                                  "MB)") from None
            raise


def _write_into(tmp: Path, out: Path, *, pieces: Iterable[tuple[str, bool]], tokenizer: TextTokenizer,
                sources: Sources, text_field: str, data: str, progress: bool) -> dict[str, Any]:
    """The work of :func:`write_prepared` inside its temporary directory ``tmp``, then moved into ``out``."""
    tokens, docs = _HashedFile(tmp / TOKENS), _HashedFile(tmp / DOCUMENTS)
    bar = tqdm(unit="tok", unit_scale=True, desc="prepare", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    with tokens.f, docs.f, bar:
        w = _write_tokens(pieces, tokenizer, tokens, docs, bar)
    if w.n_documents == 0:
        raise ConfigError("data", data, "data holding at least one non-empty document",
                          f"all {w.skipped} document(s) are empty")
    sidecar = {
        "format": FORMAT, "version": VERSION,
        "tokenizer": {"name": tokenizer.name if not tokenizer.sha256 else str(Path(tokenizer.name).resolve()),
                      "sha256": tokenizer.sha256},  # a directory as an absolute path: train runs from anywhere
        "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id, "dtype": token_dtype(tokenizer.vocab_size),
        "n_tokens": w.n_tokens, "n_documents": w.n_documents, "skipped_documents": w.skipped,
        "max_id": w.max_id,
        "files": {TOKENS: {"bytes": tokens.n, "sha256": tokens.h.hexdigest()},
                  DOCUMENTS: {"bytes": docs.n, "sha256": docs.h.hexdigest()}},
        "sources": [{"path": s.path, "size_bytes": s.size_bytes} for s in sources.files],
        "text_field": text_field,
    }
    (tmp / SIDECAR).write_text(json.dumps(sidecar, indent=1, sort_keys=True) + "\n")
    _move_into_place(tmp, out)
    return sidecar


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; into an existing (forced) directory the sidecar goes last, after the old one
    is removed, so no moment shows a sidecar next to files it does not describe."""
    (tmp / TEMPORARY_MARKER).unlink()  # not carried into out (a crash from here on leaves an unmarked tmp: kept)
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
    """The sidecar of ``directory``, its keys, their types and how they bound each other checked (not yet the
    files nor the tokenizer)."""
    path = directory / SIDECAR
    side = read_document(path, field=field, fmt="json", limits=RECORD)  # bounded: size, nesting, keys, integers
    if not isinstance(side, dict) or side.get("format") != FORMAT:
        raise _bad(field, directory, f"{path} is not a {FORMAT} sidecar")
    missing = [k for k in KEYS if k not in side]
    if missing:
        raise _bad(field, directory, f"{path} lacks {', '.join(missing)}")
    if side["version"] != VERSION:
        raise _bad(field, directory, f"{path} is format version {side['version']!r}; this trainfit reads {VERSION}")
    for key, ok in _TYPES.items():
        if not ok(side[key]):
            raise _bad(field, directory, f"{path}: {key}={_short(side[key])} is not {_TYPE_NAMES[key]}")
    for key, why in _relations(side):
        raise _bad(field, directory, f"{path}: {key}={_short(side[key])} {why}")
    return side


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


_TYPES = {"vocab_size": _count, "eod_id": _count, "n_tokens": _count, "n_documents": _count,
          "skipped_documents": _count, "max_id": _count, "dtype": lambda v: v in DTYPES,
          "files": lambda v: isinstance(v, dict), "sources": lambda v: isinstance(v, list),
          "text_field": lambda v: isinstance(v, str),
          "tokenizer": lambda v: isinstance(v, dict) and isinstance(v.get("name"), str)
          and isinstance(v.get("sha256"), str)}
_TYPE_NAMES = {**{k: "an integer >= 0" for k in ("vocab_size", "eod_id", "n_tokens", "n_documents",
                                                  "skipped_documents", "max_id")},
               "dtype": "one of " + ", ".join(DTYPES), "files": "an object", "sources": "a list",
               "text_field": "a string", "tokenizer": "an object with a name and a sha256"}


def _relations(side: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(key, why) for each sidecar value its siblings contradict (the first is reported)."""
    vocab = side["vocab_size"]
    if side["eod_id"] >= vocab:
        yield "eod_id", f"is outside the vocabulary (vocab_size={vocab:,})"
    if side["max_id"] >= vocab:
        yield "max_id", f"is outside the vocabulary (vocab_size={vocab:,})"
    if side["max_id"] < side["eod_id"]:
        yield "max_id", f"is below eod_id={side['eod_id']:,} (every document ends with it)"
    if side["dtype"] != token_dtype(vocab):
        yield "dtype", f"does not match vocab_size={vocab:,} (which is stored as {token_dtype(vocab)})"
    if side["n_documents"] < 1:
        yield "n_documents", "is not at least 1"
    if side["n_tokens"] < MIN_DOC_TOKENS * side["n_documents"]:
        yield "n_tokens", f"is below {MIN_DOC_TOKENS} per document (n_documents={side['n_documents']:,})"


def _check_tokenizer(side: dict[str, Any], directory: Path, field: str, given: TextTokenizer | None) -> None:
    """vocab_size and eod_id against the tokenizer the sidecar names (``given`` when it is that tokenizer)."""
    name, sha = side["tokenizer"]["name"], side["tokenizer"]["sha256"]
    if name == BYTE or not sha:
        if (name, sha) != (BYTE, ""):
            raise _bad(field, directory, f"{directory / SIDECAR}: tokenizer={_short(side['tokenizer'])} names no "
                                         "tokenizer (byte has no sha256, a directory has one)")
        tok = load_tokenizer(BYTE)
    elif given is not None and given.sha256 == sha:
        tok = given
    else:
        path = Path(name) / "tokenizer.json"
        if not path.is_file():
            raise ConfigError("tokenizer", name, f"the tokenizer {directory} was prepared with",
                              f"{path} is missing (moved or deleted); put it back or re-run trainfit prepare")
        if sha256_file(path) != sha:
            raise _bad(field, directory, f"{path}'s sha256 does not match prepared.json's tokenizer (changed "
                                         "since prepare)")
        tok = load_tokenizer(name)
    for key, value in (("vocab_size", tok.vocab_size), ("eod_id", tok.eod_id)):
        if side[key] != value:
            raise _bad(field, directory, f"{directory / SIDECAR}: {key}={side[key]:,} but the tokenizer "
                                         f"({tok.name}) has {key}={value:,}")


def _scan(path: Path, dtype: np.dtype | None) -> tuple[str, int]:
    """(sha256, largest id or -1) of ``path``, one chunked pass."""
    h, top = hashlib.sha256(), -1
    with open(path, "rb") as f:
        while block := f.read(READ_CHUNK):
            h.update(block)
            if dtype is not None:
                top = max(top, int(np.frombuffer(block, dtype=dtype).max()))
    return h.hexdigest(), top


def _check_files(side: dict[str, Any], directory: Path, field: str) -> None:
    """Both files' sizes and sha256 against the sidecar, and tokens.bin's largest id against max_id."""
    dtype = DTYPES[side["dtype"]]
    sizes = {TOKENS: side["n_tokens"] * dtype.itemsize, DOCUMENTS: (side["n_documents"] + 1) * 8}
    for name, size in sizes.items():
        path, entry = directory / name, side["files"].get(name)
        if not isinstance(entry, dict) or not path.is_file():
            raise _bad(field, directory, f"{path} is missing")
        if path.stat().st_size != size or entry.get("bytes") != size:
            raise _bad(field, directory, f"{path} holds {path.stat().st_size:,} bytes, the sidecar says {size:,}")
        digest, top = _scan(path, dtype if name == TOKENS else None)
        if digest != entry.get("sha256"):
            raise _bad(field, directory, f"{path}'s sha256 does not match prepared.json (changed since prepare)")
        if name == TOKENS and top != side["max_id"]:
            raise _bad(field, directory, f"{path}'s largest id is {top:,}, prepared.json's max_id={side['max_id']:,}")


def open_prepared(directory: Path, field: str = "data", *,
                  tokenizer: TextTokenizer | None = None) -> tuple[TokenStore, dict[str, Any]]:
    """A prepared directory's documents, after checking every sidecar field: types and bounds (eod_id and max_id
    inside vocab_size, dtype the one vocab_size gives, counts), vocab_size and eod_id against the tokenizer it
    names (``tokenizer``, when given and the same by sha256, saves loading it), both file sizes and sha256
    checksums, tokens.bin's largest id against max_id (in the hashing pass), the offsets, and that every
    document ends with eod_id.

    Raises:
        ConfigError: naming ``field`` (or ``tokenizer``), the file or sidecar key that does not match
            ("re-run trainfit prepare").
    """
    side = read_sidecar(directory, field)
    _check_tokenizer(side, directory, field, tokenizer)
    _check_files(side, directory, field)
    offsets = np.fromfile(directory / DOCUMENTS, dtype=OFFSET_DTYPE).astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != side["n_tokens"] or np.any(np.diff(offsets) < MIN_DOC_TOKENS):
        raise _bad(field, directory, f"{directory / DOCUMENTS} holds offsets that do not describe {TOKENS}")
    store = TokenStore(offsets=offsets, path=str(directory / TOKENS), dtype=side["dtype"])
    ends = store.tokens[offsets[1:] - 1]
    if np.any(ends != side["eod_id"]):
        k = int(np.argmax(ends != side["eod_id"]))
        raise _bad(field, directory, f"document {k:,} of {directory / TOKENS} does not end with eod_id="
                                     f"{side['eod_id']:,}")
    return store, side
