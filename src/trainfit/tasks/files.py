"""Training data from files: :class:`~trainfit.tasks.spec.DataSpec` (what to read) -> :class:`TextData` (the
datasets a task serves).

Two conventions, one choice (``packing``):

* **packing on** (pretraining): documents, each followed by its end-of-document (EOD) id, are joined into one
  token stream; row ``i`` is ``stream[i*T : i*T + T + 1]`` (input: the first T, labels: the last T, T =
  seq_len). Every label is a real token; the tail shorter than a row is dropped (the description says how
  many tokens).
* **packing off** (fine-tuning): one document per row, its tokens + EOD truncated to T + 1 (the truncated
  ones are counted), right-padded per micro-batch by :func:`~trainfit.tasks.synthetic.collate_tokens`; padded
  labels are ``IGNORE_INDEX``, so the loss sums and counts real tokens only.

Where rows come from (:attr:`TextData.source`, which ``trainfit profile`` reads for its advice):

* ``"prepared"``: a ``trainfit prepare`` directory, memory-mapped (one slice read per row);
* ``"raw-packed"``: raw files with packing on, tokenized once at load (main process, progress on stderr);
* ``"raw-on-the-fly"``: raw files with packing off, tokenized in ``__getitem__`` (DataLoader workers share it).

A document that tokenizes to nothing (with its EOD, fewer than 2 tokens: no label) is skipped and counted.
The validation split is the LAST ``ceil(val_fraction * n_documents)`` documents, or ``val_data`` (any
format), packed or padded like the training rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from trainfit.errors import ConfigError, check_choice
from trainfit.progress import bars_enabled, info
from trainfit.tasks.corpus import find_sources, read_documents
from trainfit.tasks.prepared import (
    DTYPES,
    TokenStore,
    is_prepared,
    open_prepared,
    token_dtype,
    tokenize_documents,
)
from trainfit.tasks.spec import DataSpec
from trainfit.tasks.synthetic import collate_tokens
from trainfit.tasks.tokenizer import BYTE, TextTokenizer, load_tokenizer

SOURCES = ("prepared", "raw-packed", "raw-on-the-fly")
"""Values of :attr:`TextData.source`."""


def _row(seg: np.ndarray) -> dict[str, torch.Tensor]:
    t = torch.from_numpy(np.asarray(seg, dtype=np.int64))
    return {"input_ids": t[:-1], "labels": t[1:]}


class PackedRows(Dataset):
    """Rows of T + 1 consecutive tokens of ``store``'s stream between token ``start`` and ``stop``."""

    def __init__(self, store: TokenStore, *, start: int, stop: int, seq_len: int) -> None:
        self.store, self.start, self.T = store, start, seq_len
        self.n_rows = max(0, (stop - start - 1) // seq_len)
        self.tail = (stop - start) - (self.n_rows * seq_len + 1) if self.n_rows else stop - start

    def __len__(self) -> int:
        return self.n_rows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n_rows:
            raise IndexError(i)
        a = self.start + i * self.T
        return _row(self.store.tokens[a : a + self.T + 1])  # one slice of the memory map


class DocumentRows(Dataset):
    """One document of ``store`` per row (documents ``first .. first+n``), truncated to T + 1 tokens."""

    def __init__(self, store: TokenStore, *, first: int, n: int, seq_len: int) -> None:
        self.store, self.first, self.n, self.T = store, first, n, seq_len
        lengths = np.diff(store.offsets[first : first + n + 1])
        self.truncated = int((lengths > seq_len + 1).sum())
        self.longest = int(min(lengths.max() - 1, seq_len)) if n else 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        a, b = (int(x) for x in self.store.offsets[self.first + i : self.first + i + 2])
        return _row(self.store.tokens[a : min(b, a + self.T + 1)])


class OnTheFlyRows(Dataset):
    """One document per row, tokenized when the row is read (in the DataLoader worker that reads it)."""

    def __init__(self, texts: list[str], tokenizer: TextTokenizer, *, seq_len: int) -> None:
        self.texts, self.tokenizer, self.T = texts, tokenizer, seq_len

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokenizer.encode(self.texts[i])
        row = _row(np.append(ids[: self.T + 1], self.tokenizer.eod_id)[: self.T + 1])  # tokens + EOD, cut to T + 1
        if len(ids) == 0:  # a non-empty text this tokenizer maps to nothing: one ignored position, no label
            row = {"input_ids": torch.tensor([self.tokenizer.eod_id]), "labels": torch.tensor([-100])}
        return row


@dataclass(frozen=True, kw_only=True)
class TextData:
    """The datasets a task serves from files, and the facts about them memory sizing and advice read."""

    train: Dataset
    """Rows ``{"input_ids": LongTensor[n], "labels": LongTensor[n]}``."""
    val: Dataset | None
    """The validation rows (None without a split)."""
    collate: Callable = collate_tokens
    """Right-pads a micro-batch; padded labels are IGNORE_INDEX."""
    vocab_size: int
    eod_id: int
    longest: int
    """Tokens in the longest row the data can produce (packing: seq_len)."""
    source: str
    """"prepared", "raw-packed" or "raw-on-the-fly"."""
    tokenizer_dir: str = ""
    """"" for byte, else the tokenizer directory (exported beside the model)."""
    description: str = ""
    """One line: documents, tokens, rows, what was dropped, truncated or skipped, the validation split."""

    def __post_init__(self) -> None:
        check_choice("source", self.source, SOURCES)

    def example_batch(self, n: int) -> dict[str, torch.Tensor]:
        """n rows of ``longest`` tokens with every label counted: the largest micro-batch of n rows this data
        produces (what memory sizing steps)."""
        g = torch.Generator().manual_seed(n)
        seq = torch.randint(0, self.vocab_size, (n, self.longest + 1), generator=g)
        return {"input_ids": seq[:, :-1], "labels": seq[:, 1:]}


@dataclass
class _Docs:
    """Documents read from one path: tokenized (``store``) or as texts (on the fly)."""

    name: str
    tokenizer: TextTokenizer | None
    """None for a prepared directory (its ids are stored; see ``prepared_tokenizer``)."""
    store: TokenStore | None = None
    texts: list[str] | None = None
    skipped: int = 0
    side: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.store.n_documents if self.store is not None else len(self.texts)


def _read(path: str, spec: DataSpec, tokenizer: TextTokenizer | None, *, field_name: str) -> _Docs:
    """The documents at ``path`` (``tokenizer`` None: the spec's, or the prepared directory's)."""
    if is_prepared(path):
        store, side = open_prepared(Path(path), field_name)
        return _Docs(name=path, tokenizer=None, store=store, skipped=side.get("skipped_documents", 0), side=side)
    tok = tokenizer or load_tokenizer(spec.tokenizer or BYTE)
    sources = find_sources(path, field=field_name)
    texts = read_documents(sources, text_field=spec.text_field, text_errors=spec.text_errors, field=field_name)
    if not spec.packing:  # on the fly: keep the texts; only an empty one is known to give no label
        every = list(texts)
        kept = [t for t in every if t]
        return _Docs(name=path, tokenizer=tok, texts=kept, skipped=len(every) - len(kept))
    arrays, skipped = [], 0
    for ids, _ in tokenize_documents(texts, tok, progress=bars_enabled(), desc=f"tokenizing {path}",
                                     threads=False):
        if ids is None:
            skipped += 1
        else:
            arrays.append(ids.astype(DTYPES[token_dtype(tok.vocab_size)]))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, DTYPES[token_dtype(tok.vocab_size)])
    store = TokenStore(offsets=offsets, array=tokens, dtype=token_dtype(tok.vocab_size))
    return _Docs(name=path, tokenizer=tok, store=store, skipped=skipped)


def _prepared_tokenizer(spec: DataSpec, side: dict[str, Any], path: str) -> tuple[str, int, int, str]:
    """(name, vocab_size, eod_id, sha256) of a prepared directory's tokenizer; a given tokenizer (``byte`` too)
    that is another tokenizer is refused (the ids on disk are the sidecar's). The sidecar's own name (what
    config.toml records) is not reloaded: its sha256 is the sidecar's."""
    tok = side["tokenizer"]
    name, sha = str(tok.get("name", BYTE)), str(tok.get("sha256", ""))
    if spec.tokenizer and spec.tokenizer != name:
        given = load_tokenizer(spec.tokenizer)
        if given.sha256 != sha:
            raise ConfigError("tokenizer", spec.tokenizer, f"the tokenizer {path} was prepared with ({name})",
                              "drop --tokenizer (the prepared directory's is used) or re-run trainfit prepare with it")
    return name, side["vocab_size"], side["eod_id"], sha


def _identity(docs: _Docs, spec: DataSpec) -> tuple[str, int, int, str]:
    if docs.tokenizer is None:
        return _prepared_tokenizer(spec, docs.side, docs.name)
    t = docs.tokenizer
    return t.name, t.vocab_size, t.eod_id, t.sha256


def _split_count(fraction: float, n: int) -> int:
    """ceil(fraction * n), at least 1, computed exactly (0.3 * 10 is 3.0000000000000004 in floating point)."""
    k = max(1, math.ceil(Fraction(repr(float(fraction))) * n))
    if n - k < 1:
        raise ConfigError("val_fraction", fraction, f"a fraction leaving at least 1 of the {n} document(s) for "
                          "training", f"ceil({fraction:g} x {n}) = {k} would hold out every document")
    return k


def _rows(docs: _Docs, spec: DataSpec, first: int, n: int, *, field_name: str) -> tuple[Dataset, int, str]:
    """(dataset, longest row, description) of documents ``first .. first+n`` of ``docs``."""
    T = spec.seq_len
    if docs.store is None:  # on the fly
        texts = docs.texts[first : first + n]
        counts = [docs.tokenizer.count(t) for t in texts]
        ds = OnTheFlyRows(texts, docs.tokenizer, seq_len=T)
        if any(c is None for c in counts):
            return ds, T, (f"{n:,} documents, one per row, tokenized as rows are read (token counts unknown until "
                           "then; `trainfit prepare` counts them), padded per micro-batch")
        truncated = sum(c + 1 > T + 1 for c in counts)
        return ds, min(max(counts), T), (f"{n:,} documents, {sum(counts) + n:,} tokens, one per row tokenized as "
                                         f"rows are read, padded per micro-batch ({truncated:,} truncated to {T + 1} "
                                         "tokens)")
    off = docs.store.offsets
    n_tokens = int(off[first + n] - off[first])
    if spec.packing:
        ds = PackedRows(docs.store, start=int(off[first]), stop=int(off[first + n]), seq_len=T)
        if len(ds) == 0:
            raise ConfigError(field_name, docs.name if field_name != "val_fraction" else spec.val_fraction,
                              f"data of at least seq_len + 1 = {T + 1} tokens to pack into one row",
                              f"these {n:,} document(s) hold {n_tokens:,} tokens")
        return ds, T, (f"{n:,} documents, {n_tokens:,} tokens, packed into {len(ds):,} rows of {T} "
                       f"(tail of {ds.tail:,} tokens dropped)")
    ds = DocumentRows(docs.store, first=first, n=n, seq_len=T)
    return ds, ds.longest, (f"{n:,} documents, {n_tokens:,} tokens, one per row padded per micro-batch "
                            f"({ds.truncated:,} truncated to {T + 1} tokens)")


_CACHE: dict[tuple, TextData] = {}
"""load_text_data's results in this process, keyed by the spec and the files' sizes and times."""
_SAID: set[str] = set()


def note(message: str) -> None:
    """Print ``trainfit: MESSAGE`` on stderr, once per process (tasks are built several times per command)."""
    if message not in _SAID:
        _SAID.add(message)
        info("data", message)


def clear_cache() -> None:
    """Forget loaded data and printed notes (a long-lived process that runs several commands, e.g. tests)."""
    _CACHE.clear()
    _SAID.clear()


def _signature(path: str) -> tuple:
    if not path:
        return ()
    p = Path(path)
    files = sorted(q for q in p.iterdir() if q.is_file()) if p.is_dir() and is_prepared(p) else []
    if not files:
        try:
            files = [Path(s.path) for s in find_sources(path).files]
        except ConfigError:
            return ("?",)  # the load reports it
    return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)


def load_text_data(spec: DataSpec) -> TextData:
    """Read, tokenize (or map) and cut ``spec``'s data into rows; cached per spec in this process.

    Raises:
        ConfigError: naming the field (data, val_data, val_fraction, text_field, text_errors, tokenizer) for every
            input that cannot be read as the spec says; nothing is written.
    """
    key = (spec, _signature(spec.data), _signature(spec.val_data))
    if key not in _CACHE:
        _CACHE[key] = _load(spec)
        note(f"data: {_CACHE[key].description}")
    return _CACHE[key]


def _load(spec: DataSpec) -> TextData:
    train = _read(spec.data, spec, None, field_name="data")
    name, vocab, eod, sha = _identity(train, spec)
    if train.n == 0:
        raise ConfigError("data", spec.data, "data holding at least one non-empty document",
                          f"all {train.skipped:,} document(s) are empty")
    extra = [f"{train.skipped:,} empty document(s) skipped"] if train.skipped else []
    n_train, val = train.n, None
    if spec.val_fraction:
        k = _split_count(spec.val_fraction, train.n)
        n_train = train.n - k
        val_ds, _, val_text = _rows(train, spec, n_train, k, field_name="val_fraction")
        val = (val_ds, f"validation: the last {val_text}")
    elif spec.val_data:
        tok = train.tokenizer or (load_tokenizer(name) if name != BYTE else load_tokenizer(BYTE))
        held = _read(spec.val_data, spec, tok if not is_prepared(spec.val_data) else None, field_name="val_data")
        if _identity(held, spec)[1:] != (vocab, eod, sha):
            raise ConfigError("val_data", spec.val_data, f"data prepared with the training data's tokenizer ({name})",
                              "re-run trainfit prepare on it with --tokenizer of the training data")
        if held.n == 0:
            raise ConfigError("val_data", spec.val_data, "data holding at least one non-empty document")
        val_ds, _, val_text = _rows(held, spec, 0, held.n, field_name="val_data")
        val = (val_ds, f"validation {spec.val_data}: {val_text}")
    train_ds, longest, text = _rows(train, spec, 0, n_train, field_name="data")
    source = "prepared" if train.tokenizer is None else ("raw-packed" if spec.packing else "raw-on-the-fly")
    description = f"{spec.data}: {text}" + "".join(f"; {e}" for e in extra) + (f"; {val[1]}" if val else "")
    return TextData(train=train_ds, val=val[0] if val else None, vocab_size=vocab, eod_id=eod,
                    longest=max(longest, 1), source=source, tokenizer_dir="" if name == BYTE else name,
                    description=description)
