"""Reading documents from files: text, JSON Lines, Parquet, CSV (one pass, streaming, deterministic order).

What a path means:

* a file: read by its extension (:data:`TEXT_SUFFIXES` -> one document per file; ``.jsonl`` -> one per line;
  ``.parquet`` / ``.csv`` -> one per row). Another extension is refused, listing the formats.
* a ``datasets`` ``save_to_disk`` folder (:data:`DATASET_FILES`): its rows, one document per row, read through
  the ``datasets`` library (the ``datasets`` extra) from the ``.arrow`` files its state.json lists, in that order;
  the text column is ``text_field``, as for Parquet. A ``DatasetDict`` folder (:data:`DATASET_DICT_FILE`) is read
  as its ``train`` split; its validation split is the job's validation data unless another is given
  (:func:`validation_split`).
* a directory: every file under it, recursively, in sorted path order; hidden files and directories and
  ``__pycache__`` are skipped. A file no reader takes is refused, naming it: it is never skipped into training on
  the rest (a ``datasets`` folder read as its JSON metadata was that). The files of a ``trainfit prepare``
  directory inside it (one holding prepared.json and tokens.bin) are never documents; a ``datasets`` folder inside
  it is read as its rows, its metadata never.
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
from trainfit.gate import listed, read_document

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".java", ".js",
                 ".ts", ".go", ".rs", ".sh", ".html", ".htm", ".xml", ".tex", ".json", ".toml", ".yaml", ".yml")
"""Extensions read as one plain-text document per file."""
TABLE_SUFFIXES = (".jsonl", ".parquet", ".csv")
FORMATS = "text files (" + " ".join(TEXT_SUFFIXES) + "), .jsonl, .parquet, .csv, a `datasets` save_to_disk " \
          "folder, a directory or glob of them, or a `trainfit prepare` directory"
BATCH_ROWS = 4096
"""Rows per pyarrow record batch (bounded memory on a large table)."""
READ_BYTES = 1 << 18
"""Bytes of a text file read and decoded at a time by :func:`read_pieces` (256 KiB)."""
BOM = "\ufeff"
"""A UTF-8 byte order mark at the start of a file is not text: it is dropped (pyarrow's CSV reader does the same)."""
PREPARED_FILES = ("prepared.json", "tokens.bin")
"""A directory holding both is a `trainfit prepare` output: its files are never read as documents."""
DATASET_FILES = ("state.json", "dataset_info.json")
"""A directory holding both is a ``datasets.Dataset.save_to_disk`` folder: its rows are documents, these never."""
DATASET_DICT_FILE = "dataset_dict.json"
"""A directory holding it is a ``datasets.DatasetDict.save_to_disk`` folder: one Dataset folder per split."""
TRAIN_SPLIT = "train"
VALIDATION_SPLITS = ("validation", "valid", "val", "dev")
"""A DatasetDict's split read as validation data (the first found), unless --val-data or --val-fraction is given."""


@dataclass(frozen=True, kw_only=True)
class Source:
    """One input file."""

    path: str
    size_bytes: int
    kind: str
    """"text", "jsonl", "parquet", "csv" or "arrow" (a file of a ``datasets`` folder)."""


@dataclass(frozen=True, kw_only=True)
class Sources:
    files: tuple[Source, ...]


def _kind(path: Path) -> str | None:
    s = path.suffix.lower()
    if s == ".arrow" and dataset_kind(path.parent) == "dataset":
        return "arrow"
    if s in TEXT_SUFFIXES:
        return "text"
    return s[1:] if s in TABLE_SUFFIXES else None


# --------------------------------------------------------------------------------------------- datasets folders


def dataset_kind(directory: str | Path) -> str | None:
    """"dataset" for a ``Dataset.save_to_disk`` folder, "dict" for a ``DatasetDict`` one, else None (only the
    names of its files are looked at: nothing is imported or read)."""
    d = Path(directory).expanduser()
    if (d / DATASET_DICT_FILE).is_file():
        return "dict"
    return "dataset" if all((d / n).is_file() for n in DATASET_FILES) else None


def _splits(directory: Path, field: str) -> dict[str, Path]:
    """A DatasetDict folder's splits (name -> its Dataset folder), from dataset_dict.json (read through the gate)."""
    doc = read_document(directory / DATASET_DICT_FILE, field=field, fmt="json")
    names = doc.get("splits") if isinstance(doc, dict) else None
    if not (isinstance(names, list) and names and all(isinstance(n, str) and n for n in names)):
        raise ConfigError(field, str(directory / DATASET_DICT_FILE), 'a datasets dataset_dict.json: {"splits": '
                          '["train", ...]}', "it names no splits")
    splits = {n: directory / n for n in names}
    for name, folder in splits.items():
        if Path(name).name != name or dataset_kind(folder) != "dataset":
            raise ConfigError(field, str(folder), f"the folder of split {name!r} written by save_to_disk",
                              f"{DATASET_DICT_FILE} names it, but it holds no {' and '.join(DATASET_FILES)}")
    return splits


def _split_read(directory: Path, field: str) -> Path:
    """The split of a DatasetDict that ``field`` reads: ``train`` for --data, the validation split for
    --val-data; refused, listing the splits, where it has none."""
    splits = _splits(directory, field)
    wanted = VALIDATION_SPLITS if field == "val_data" else (TRAIN_SPLIT,)
    name = next((n for n in wanted if n in splits), None)
    if name is None:
        raise ConfigError(field, str(directory), f"a DatasetDict with a {' or '.join(map(repr, wanted))} split, or "
                          "one split's folder", f"its splits are {listed(splits)}; pass {directory}/SPLIT")
    return splits[name]


def validation_split(spec: str) -> str:
    """The validation split's folder of the DatasetDict ``spec`` names ("" when it is none or has none): the
    validation data of a job that names no other."""
    d = Path(spec).expanduser() if spec and not any(c in spec for c in "*?[") else None
    if d is None or dataset_kind(d) != "dict":
        return ""
    splits = _splits(d, "data")
    return next((str(splits[n]) for n in VALIDATION_SPLITS if n in splits), "")


def _arrow_files(folder: Path, field: str) -> list[Path]:
    """The data files of a Dataset folder, in the order its state.json lists them (the rows' order)."""
    state = read_document(folder / "state.json", field=field, fmt="json")
    entries = state.get("_data_files") if isinstance(state, dict) else None
    names = [e.get("filename") for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
    if not names or not all(isinstance(n, str) and n and Path(n).name == n for n in names):
        raise ConfigError(field, str(folder / "state.json"), "a datasets state.json listing its .arrow files "
                          '("_data_files")', "it lists none, or a name that is not a file of the folder")
    files = [folder / n for n in names]
    for f in files:
        if not f.is_file() or f.suffix != ".arrow":
            raise ConfigError(field, str(f), "a .arrow data file of the datasets folder",
                              "state.json lists it, but it is missing or not .arrow; save the dataset again")
    return files


def _dataset_sources(directory: Path, field: str) -> list[Path]:
    """The .arrow files a datasets folder (a Dataset, or a DatasetDict's split, :func:`_split_read`) is read from."""
    folder = _split_read(directory, field) if dataset_kind(directory) == "dict" else directory
    return _arrow_files(folder, field)


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
        ConfigError: naming ``field``: nothing at the path, a glob matching no file, a file of another format (the
            first such file of a directory or glob, named: none is skipped), a directory or glob holding no
            readable file, a ``datasets`` folder whose metadata is unreadable.
    """
    path = Path(spec).expanduser()
    if any(c in spec for c in "*?["):
        top = Path(*Path(os.path.expanduser(spec)).parts[:_glob_start(spec)] or ".")
        found = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True))
        candidates = _not_prepared([p for p in found if p.is_file() and _visible(_below(p, top))])
        if not candidates:
            raise ConfigError(field, spec, "a glob matching at least one file")
    elif path.is_dir():
        top = path
        found = sorted(p for p in path.rglob("*") if p.is_file() and _visible(p.relative_to(path)))
        candidates = _not_prepared(found)
    elif path.is_file():
        top = None  # one file named: read as it is (one shard of a datasets folder too)
        candidates = [path]
        if path.name in (*DATASET_FILES, DATASET_DICT_FILE) and dataset_kind(path.parent):
            raise ConfigError(field, spec, FORMATS, f"it is the metadata of the datasets folder {path.parent}; "
                              f"pass the folder: --{field.replace('_', '-')} {path.parent}")
    else:
        raise _not_a_file(spec, path, field)
    candidates = _datasets_read(candidates, top, field)
    unknown = [p for p in candidates if _kind(p) is None]
    if unknown:
        raise _unreadable(spec, path, unknown, field)
    if not candidates:
        raise ConfigError(field, spec, FORMATS, "it holds no file (hidden ones and __pycache__ are not read)")
    return Sources(files=tuple(Source(path=str(p), size_bytes=p.stat().st_size, kind=_kind(p)) for p in candidates))


def _unreadable(spec: str, path: Path, unknown: list[Path], field: str) -> ConfigError:
    """A file no reader takes, named: refused, never skipped into training on the other files."""
    if [path] == unknown:
        return ConfigError(field, spec, FORMATS, f"{path.suffix or 'no extension'} is none of them")
    return ConfigError(field, str(unknown[0]), FORMATS,
                       f"a file {spec} holds that no reader takes ({len(unknown):,} in all: "
                       f"{listed(p.name for p in unknown)}); nothing is skipped: move such files out or name the "
                       "files to read with a glob")


def _dataset_root(p: Path, top: Path) -> Path | None:
    """The ``datasets`` folder a file belongs to (a DatasetDict over its split's folder), at or below ``top``."""
    for folder in (p.parent.parent, p.parent):
        if (folder == top or top in folder.parents) and dataset_kind(folder):
            return folder
    return None


def _datasets_read(candidates: list[Path], top: Path | None, field: str) -> list[Path]:
    """``candidates`` with the files of each ``datasets`` folder among them replaced by the data files read from
    it, in its own order, once: its metadata and other splits are never documents."""
    if top is None:
        return candidates
    out: list[Path] = []
    done: set[Path] = set()
    for p in candidates:
        root = _dataset_root(p, top)
        if root is None:
            out.append(p)
        elif root not in done:
            done.add(root)
            out.extend(_dataset_sources(root, field))
    return out


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


def _datasets(field: str, where: str):
    try:
        import datasets  # lazy: only a datasets folder needs it (and it imports much)
    except ImportError:
        raise ConfigError(field, where, "text, JSON Lines, Parquet or CSV (the datasets library, which reads a "
                          "save_to_disk folder, is not installed)", "install it with `pip install "
                          "'trainfit[datasets]'`") from None
    return datasets


def _arrow(src: Source, text_field: str, field: str) -> Iterator[str]:
    """The ``text_field`` column of one data file of a ``datasets`` folder, read by the datasets library
    (memory-mapped, in record batches): refused as a Parquet column is (missing, not strings, a null row)."""
    library = _datasets(field, src.path)
    try:
        ds = library.Dataset.from_file(src.path, in_memory=False)
    except Exception as e:  # noqa: BLE001 - pyarrow's and datasets' errors: the file is unusable either way
        raise ConfigError(field, src.path, "a readable .arrow file of a datasets folder",
                          (str(e).splitlines() or [type(e).__name__])[0][:160]) from None
    if text_field not in ds.column_names:
        raise ConfigError("text_field", text_field, "one of the columns: " + listed(ds.column_names, 20),
                          f"{src.path} has no column {text_field!r}; pass --text-field NAME")
    kind = getattr(ds.features[text_field], "dtype", type(ds.features[text_field]).__name__)
    if kind not in ("string", "large_string"):
        raise ConfigError("text_field", text_field, "a column of strings", f"{src.path}: its type is {kind}")
    row = 0
    for batch in ds.select_columns([text_field]).with_format("arrow").iter(batch_size=BATCH_ROWS):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                raise ConfigError("text_field", text_field, "a column of strings", f"{src.path}: row {row} is null")
            yield text


def check_text_field(sources: Sources, text_field: str, *, default: str = "text") -> None:
    """Refuse a ``text_field`` other than the default where no source has fields (text files are one document
    each): it would be silently ignored."""
    if text_field != default and all(s.kind == "text" for s in sources.files):
        raise ConfigError("text_field", text_field, "a setting of JSON Lines, Parquet, CSV or datasets data",
                          "the data is text files (one document per file), so it would be ignored: drop it")


def _rows(src: Source, text_field: str, errors: str, field: str) -> Iterator[str]:
    """The documents of a file with fields: a JSON Lines line, a table row, a datasets row each."""
    if src.kind == "jsonl":
        return _jsonl(src, text_field, errors, field)
    return _arrow(src, text_field, field) if src.kind == "arrow" else _table(src, text_field, field)


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
            yield from ((text, True) for text in _rows(src, text_field, text_errors, field))


def read_documents(sources: Sources, *, text_field: str = "text", text_errors: str = "strict",
                   field: str = "data") -> Iterator[str]:
    """Every document's text, in order: one file at a time (a text file is read whole: it is one document)."""
    for src in sources.files:
        if src.kind == "text":
            text = decode(Path(src.path).read_bytes(), where=src.path, errors=text_errors, field=field)
            yield text[1:] if text.startswith(BOM) else text
        else:
            yield from _rows(src, text_field, text_errors, field)
