"""Reading documents from files: text, JSON Lines, Parquet, CSV (one pass, streaming, deterministic order).

What a path means:

* a file: read by its extension (:data:`TEXT_SUFFIXES` -> one document per file; ``.jsonl`` -> one per line;
  ``.parquet`` / ``.csv`` -> one per row). Another extension is refused, listing the formats.
* a directory: every file under it, recursively, in sorted path order; hidden files and directories and
  ``__pycache__`` are skipped, and files of other extensions are skipped and counted. The files of a
  ``trainfit prepare`` directory inside it (one holding prepared.json and tokens.bin) are never documents.
* a glob (``*``, ``?``, ``[``; ``**`` recursive): the files it matches, sorted, read like a directory's.

Text must be UTF-8. ``text_errors="strict"`` refuses the first invalid byte naming the file and its byte
offset; ``"replace"`` decodes it as U+FFFD. A UTF-8 byte order mark starting a file is dropped. Parquet and
CSV are read with pyarrow, one column in record batches (``datasets`` is built on the same pyarrow read and adds
a cache directory, fingerprinting and many dependencies for what is one columnar read here).
"""

from __future__ import annotations

import codecs
import glob
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainfit.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".java", ".js",
                 ".ts", ".go", ".rs", ".sh", ".html", ".htm", ".xml", ".tex", ".json", ".toml", ".yaml", ".yml")
"""Extensions read as one plain-text document per file."""
TABLE_SUFFIXES = (".jsonl", ".parquet", ".csv")
FORMATS = "text files (" + " ".join(TEXT_SUFFIXES) + "), .jsonl, .parquet, .csv, a directory or glob of them, " \
          "or a `trainfit prepare` directory"
BATCH_ROWS = 4096
"""Rows per pyarrow record batch (bounded memory on a large table)."""
READ_BYTES = 1 << 18
"""Bytes of a text file read and decoded at a time by :func:`read_pieces` (256 KiB)."""
BOM = "\ufeff"
"""A UTF-8 byte order mark at the start of a file is not text: it is dropped (pyarrow's CSV reader does the same)."""
PREPARED_FILES = ("prepared.json", "tokens.bin")
"""A directory holding both is a `trainfit prepare` output: its files are never read as documents."""


@dataclass(frozen=True, kw_only=True)
class Source:
    """One input file."""

    path: str
    size_bytes: int
    kind: str
    """"text", "jsonl", "parquet" or "csv"."""


@dataclass(frozen=True, kw_only=True)
class Sources:
    files: tuple[Source, ...]
    skipped_files: int = 0
    """Files of a directory or glob with an extension no reader takes."""


def _kind(path: Path) -> str | None:
    s = path.suffix.lower()
    if s in TEXT_SUFFIXES:
        return "text"
    return s[1:] if s in TABLE_SUFFIXES else None


def _visible(rel: Path) -> bool:
    return not any(p.startswith(".") or p == "__pycache__" for p in rel.parts)


def _prepared_dir(directory: Path, seen: dict[Path, bool]) -> bool:
    if directory not in seen:
        seen[directory] = all((directory / n).is_file() for n in PREPARED_FILES)
    return seen[directory]


def _not_prepared(paths: list[Path]) -> list[Path]:
    """``paths`` less the files of prepared directories (prepared.json is a .json text file otherwise)."""
    seen: dict[Path, bool] = {}
    return [p for p in paths if not _prepared_dir(p.parent, seen)]


def _not_a_file(spec: str, path: Path, field: str) -> ConfigError:
    """What is at ``path`` when it is neither a regular file nor a directory."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return ConfigError(field, spec, "an existing file, directory or glob", f"nothing exists at {spec}")
    what = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else \
        "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
    return ConfigError(field, spec, "a regular file, a directory or a glob", f"{spec} is {what}, not a regular file")


def _glob_start(spec: str) -> int:
    """Index of the first path component holding a glob character."""
    parts = Path(os.path.expanduser(spec)).parts
    return next(i for i, q in enumerate(parts) if any(c in q for c in "*?["))


def _below(p: Path, root: Path) -> Path:
    """``p`` relative to the glob's fixed prefix ``root`` (only what the glob matched is checked for hidden parts)."""
    try:
        return p.relative_to(root)
    except ValueError:
        return p


def find_sources(spec: str, *, field: str = "data") -> Sources:
    """The files ``spec`` names, in reading order.

    Raises:
        ConfigError: naming ``field``: nothing at the path, a glob matching no file, a file of another format, a
            directory or glob holding no readable file.
    """
    path = Path(spec).expanduser()
    if any(c in spec for c in "*?["):
        found = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True))
        root = Path(*Path(os.path.expanduser(spec)).parts[:_glob_start(spec)] or ".")
        candidates = _not_prepared([p for p in found if p.is_file() and _visible(_below(p, root))])
        if not candidates:
            raise ConfigError(field, spec, "a glob matching at least one file")
    elif path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and _visible(p.relative_to(path)))
        candidates = _not_prepared(found)
    elif path.is_file():
        if _kind(path) is None:
            raise ConfigError(field, spec, FORMATS, f"{path.suffix or 'no extension'} is none of them")
        candidates = [path]
    else:
        raise _not_a_file(spec, path, field)
    files = tuple(Source(path=str(p), size_bytes=p.stat().st_size, kind=_kind(p)) for p in candidates if _kind(p))
    if not files:
        raise ConfigError(field, spec, FORMATS, f"none of its {len(candidates)} file(s) has one of these extensions")
    return Sources(files=files, skipped_files=len(candidates) - len(files))


def reads_under(spec: str, directory: Path) -> bool:
    """True when the path or glob ``spec`` could read a file written under ``directory`` (a directory inside a
    --data directory; under a glob's fixed part, at a depth the glob reaches)."""
    d = Path(directory).expanduser().resolve()
    if any(c in spec for c in "*?["):
        parts = Path(os.path.expanduser(spec)).parts
        start = _glob_start(spec)
        root, rest = Path(*parts[:start] or ".").resolve(), parts[start:]
        try:
            depth = len(d.relative_to(root).parts)
        except ValueError:
            return False
        return "**" in rest or len(rest) > depth
    p = Path(spec).expanduser().resolve()
    return p.is_dir() and (d == p or p in d.parents)


def decode(data: bytes, *, where: str, errors: str, base_offset: int = 0, field: str = "data") -> str:
    """``data`` as UTF-8 text; with ``errors="strict"`` an invalid byte is refused naming ``where`` and its offset."""
    try:
        return data.decode("utf-8", errors="strict" if errors == "strict" else "replace")
    except UnicodeDecodeError as e:
        raise ConfigError(field, where, "UTF-8 text",
                          f"byte offset {base_offset + e.start} is not UTF-8; pass --text-errors replace to read "
                          "such bytes as U+FFFD") from None


def _jsonl(src: Source, text_field: str, errors: str, field: str) -> Iterator[str]:
    offset = 0
    with open(src.path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            if lineno == 1 and raw.startswith(BOM.encode()):
                raw, start = raw[3:], 3
            line = decode(raw, where=f"{src.path}:{lineno}", errors=errors, base_offset=start, field=field)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ConfigError(field, f"{src.path}:{lineno}", "JSON Lines: one JSON object per line",
                                  f"not JSON: {e}") from None
            if not isinstance(obj, dict) or text_field not in obj:
                keys = ", ".join(list(obj)[:10]) if isinstance(obj, dict) else f"a JSON {type(obj).__name__}"
                raise ConfigError("text_field", text_field, f"a field every line of {src.path} holds",
                                  f"line {lineno} holds {keys or 'no keys'}; pass --text-field NAME")
            text = obj[text_field]
            if not isinstance(text, str):
                raise ConfigError("text_field", text_field, "a field holding a string",
                                  f"{src.path}:{lineno} holds a JSON {type(text).__name__} there")
            yield text


def _pyarrow():
    try:
        import pyarrow  # lazy: only Parquet and CSV need it
        import pyarrow.csv
        import pyarrow.parquet
    except ImportError:
        raise ConfigError("data", "*.parquet/*.csv", "text or JSON Lines (pyarrow is not installed)",
                          "install it with `pip install 'trainfit[data]'`") from None
    return pyarrow


def _table(src: Source, text_field: str, field: str) -> Iterator[str]:
    pa = _pyarrow()
    try:
        if src.kind == "parquet":
            pf = pa.parquet.ParquetFile(src.path)
            schema = pf.schema_arrow
            batches = lambda: pf.iter_batches(batch_size=BATCH_ROWS, columns=[text_field])  # noqa: E731
        else:
            types = pa.csv.ConvertOptions(column_types={text_field: pa.string()})
            reader = pa.csv.open_csv(src.path, convert_options=types)
            schema = reader.schema
            batches = lambda: reader  # noqa: E731
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(field, src.path, f"a readable {src.kind} file", str(e).splitlines()[0][:160]) from None
    if text_field not in schema.names:
        raise ConfigError("text_field", text_field, "one of the columns: " + ", ".join(schema.names[:20]),
                          f"{src.path} has no column {text_field!r}; pass --text-field NAME")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError("text_field", text_field, "a column of strings", f"{src.path}: its type is {kind}")
    row = 0
    try:
        for batch in batches():
            for text in batch.column(batch.schema.get_field_index(text_field)).to_pylist():
                row += 1
                if text is None:
                    raise ConfigError("text_field", text_field, "a column of strings",
                                      f"{src.path}: row {row} is null")
                yield text
    except pa.ArrowException as e:
        raise ConfigError(field, src.path, f"a readable {src.kind} file",
                          f"after row {row}: {str(e).splitlines()[0][:160]}") from None


def _text_chunks(src: Source, errors: str, field: str, size: int) -> Iterator[str]:
    """A text file decoded ``size`` bytes at a time (a character split across reads is completed by the next);
    a leading byte order mark dropped."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict" if errors == "strict" else "replace")
    offset, first = 0, True
    with open(src.path, "rb") as f:
        while True:
            raw = f.read(size)
            pending = len(decoder.getstate()[0])
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise ConfigError(field, src.path, "UTF-8 text",
                                  f"byte offset {offset - pending + e.start} is not UTF-8; pass --text-errors replace "
                                  "to read such bytes as U+FFFD") from None
            offset += len(raw)
            if first and text.startswith(BOM):
                text = text[1:]
            first = first and not text
            if text or not raw:
                yield text
            if not raw:
                return


def read_pieces(sources: Sources, *, text_field: str = "text", text_errors: str = "strict", field: str = "data",
                read_bytes: int = READ_BYTES) -> Iterator[tuple[str, bool]]:
    """Every document's text, in order, as ``(piece, ends_document)``: a text file in pieces of at most
    ``read_bytes`` bytes (its last piece may be ""), a JSON Lines line or a table row as one piece."""
    for src in sources.files:
        if src.kind == "text":
            chunks = _text_chunks(src, text_errors, field, read_bytes)
            piece = next(chunks)
            for following in chunks:
                yield piece, False
                piece = following
            yield piece, True
        else:
            rows = _jsonl(src, text_field, text_errors, field) if src.kind == "jsonl" else \
                _table(src, text_field, field)
            yield from ((text, True) for text in rows)


def read_documents(sources: Sources, *, text_field: str = "text", text_errors: str = "strict",
                   field: str = "data") -> Iterator[str]:
    """Every document's text, in order: one file at a time (a text file is read whole: it is one document)."""
    for src in sources.files:
        if src.kind == "text":
            text = decode(Path(src.path).read_bytes(), where=src.path, errors=text_errors, field=field)
            yield text[1:] if text.startswith(BOM) else text
        elif src.kind == "jsonl":
            yield from _jsonl(src, text_field, text_errors, field)
        else:
            yield from _table(src, text_field, field)
