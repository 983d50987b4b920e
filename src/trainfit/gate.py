"""The one gate for structured input: every TOML, JSON or YAML document trainfit reads, every integer it reads
from text, every file it writes to and every count that starts processes passes here, with stated bounds.

A document past a bound is refused in one line (a :class:`~trainfit.errors.ConfigError`, or the error class the
caller names, e.g. :class:`~trainfit.errors.CheckpointError` for a checkpoint's sidecar) *before* the rest of
trainfit sees it: no ``RecursionError``, no ``ValueError`` from Python's integer-digit limit, no parse that takes
minutes, no duplicate key silently resolved. Pure: the standard library (and PyYAML, imported only for YAML).

The bounds (``docs/reliability.md`` lists them):

=====================  ==========================  =====================================================
                       :data:`CONFIG`              :data:`RECORD`
=====================  ==========================  =====================================================
what                   a file the user wrote: a    a file trainfit wrote and reads back: ``prepared.json``,
                       TOML config, a ``--from``   a checkpoint's sidecar, an export's ``trainfit.json``,
                       file, an hf ``config.json``  the summary of a run
bytes                  1 MiB                       64 MiB
nesting                32 levels                   64 levels
keys and items         10,000                      1,000,000
integers               |n| < 2**63                 |n| < 2**63
=====================  ==========================  =====================================================
"""

from __future__ import annotations

import functools
import json
import os
import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainfit.errors import ConfigError, refusal, shown


@dataclass(frozen=True)
class Limits:
    """What one document may hold: its size in bytes, its nesting depth, its keys and list items together."""

    max_bytes: int
    max_depth: int
    max_items: int
    max_int: int = 2**63 - 1

    def words(self) -> str:
        return (f"at most {_size(self.max_bytes)}, {self.max_depth} levels of nesting and {self.max_items:,} keys "
                f"and items, integers below 2**63")


CONFIG = Limits(max_bytes=2**20, max_depth=32, max_items=10_000)
"""A file a user wrote (a config, a ``--from`` file, a model's ``config.json``)."""

RECORD = Limits(max_bytes=64 * 2**20, max_depth=64, max_items=1_000_000)
"""A file trainfit wrote and reads back (sidecars, ``prepared.json``, summaries): larger, still bounded."""

MAX_INT_TEXT_DIGITS = 19
"""The longest integer read from text (``2**63`` has 19 digits); longer ones are refused before conversion."""

_INT = re.compile(r"[+-]?[0-9]+", flags=re.ASCII)
_FORMATS = ("toml", "json", "yaml")


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 else f"{n // 2**10} KiB"


def _refuse(error: Callable[..., Exception], field: str, value: object, allowed: str, fix: str) -> Exception:
    if error is ConfigError:
        return ConfigError(field, value, allowed, fix)
    return error(refusal(field, value, allowed, fix))


def parse_int(field: str, text: object, *, minimum: int | None = None, maximum: int | None = None,
              error: Callable[..., Exception] = ConfigError) -> int:
    """The one parser of an integer from text (a flag, a key=value spec, a file's string): ASCII digits with an
    optional sign, at most :data:`MAX_INT_TEXT_DIGITS` digits, within ``[minimum, maximum]`` when given.

    ``"²"``, ``"١٢"`` (``str.isdigit`` says yes to both), ``"1e3"``, ``"0x10"``, ``" 3 "`` with inner spaces and a
    5,000-digit string are refused naming ``field``; an ``int`` (not ``bool``) is range-checked as it is."""
    if isinstance(text, bool):
        raise _refuse(error, field, text, _int_words(minimum, maximum), "a boolean is not a count")
    if isinstance(text, int):
        value = text
    else:
        s = str(text).strip() if isinstance(text, str) else None
        if s is None or not _INT.fullmatch(s) or len(s.lstrip("+-").lstrip("0")) > MAX_INT_TEXT_DIGITS:
            raise _refuse(error, field, text, _int_words(minimum, maximum), "an integer written in ASCII digits")
        value = int(s)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise _refuse(error, field, text, _int_words(minimum, maximum), "out of range")
    return value


_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", flags=re.ASCII)


def parse_scalar(field: str, text: str) -> int | float | bool | str:
    """A ``key=value`` spec's value (``--model-config n_layer=2,dropout=0.1,bias=false``): an ASCII integer through
    :func:`parse_int`, an ASCII decimal as a finite float, ``true``/``false`` as a bool, anything else as the text
    itself -- so ``n_layer=١٢`` stays text (and the key's type check refuses it), not 12, and 5,000 digits are
    refused naming ``field`` instead of becoming ``inf``."""
    s = text.strip()
    if _INT.fullmatch(s):
        return parse_int(field, s)
    if _FLOAT.fullmatch(s):
        value = float(s)
        if value in (float("inf"), float("-inf")):
            raise ConfigError(field, text, "a finite number", "it overflows a float")
        return value
    return {"true": True, "false": False}.get(s.lower(), text)


def _int_words(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an integer in [{minimum}, {maximum:,}]"
    if minimum is not None:
        return f"an integer >= {minimum} with at most {MAX_INT_TEXT_DIGITS} digits"
    return f"an integer with at most {MAX_INT_TEXT_DIGITS} digits"


def listed(items: Iterable[object], limit: int = 8) -> str:
    """``a, b, c`` -- at most ``limit`` items, each cut like a value, then ``... (N more)``: every message that
    lists things (unknown keys, files, choices) goes through here, so no list can make a line long."""
    items = list(items)
    head = ", ".join(i if isinstance(i, str) and i.isprintable() and len(i) <= 60 else shown(i, 60)
                     for i in items[:limit])
    return head + (f", ... ({len(items) - limit:,} more)" if len(items) > limit else "")


# --------------------------------------------------------------------------------------------- documents


def read_document(path: str | Path, *, field: str, fmt: str | None = None, limits: Limits = CONFIG,
                  error: Callable[..., Exception] = ConfigError) -> Any:
    """Read the TOML, JSON or YAML document at ``path`` (``fmt`` from the suffix when not given) within
    ``limits``, refused in one line naming ``field`` and the path otherwise (a missing or unreadable file too)."""
    p = Path(path)
    fmt = fmt or _format_of(p)
    try:
        info = p.stat()
    except OSError as e:
        raise _refuse(error, field, str(path), f"an existing {fmt.upper()} file", e.strerror or type(e).__name__)
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(error, field, str(path), f"a regular {fmt.upper()} file", "not a regular file")
    if info.st_size > limits.max_bytes:
        raise _refuse(error, field, str(path), f"a {fmt.upper()} file of {limits.words()}",
                      f"it has {info.st_size:,} bytes")
    try:
        with open(p, "rb") as f:
            raw = f.read(limits.max_bytes + 1)
    except OSError as e:
        raise _refuse(error, field, str(path), f"a readable {fmt.upper()} file", e.strerror or type(e).__name__)
    if len(raw) > limits.max_bytes:  # grew since the stat
        raise _refuse(error, field, str(path), f"a {fmt.upper()} file of {limits.words()}", "it is larger")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _refuse(error, field, str(path), f"a UTF-8 {fmt.upper()} file", f"byte {e.start} is not UTF-8")
    return parse_document(text, field=f"{field}", fmt=fmt, limits=limits, error=error, source=str(path))


def parse_document(text: str, *, field: str, fmt: str, limits: Limits = CONFIG,
                   error: Callable[..., Exception] = ConfigError, source: str | None = None) -> Any:
    """Parse ``text`` as ``fmt`` (toml, json or yaml) within ``limits``; see :func:`read_document`."""
    if fmt not in _FORMATS:
        raise ValueError(f"fmt must be one of {_FORMATS}")
    shown_value = source if source is not None else text
    allowed = f"a {fmt.upper()} document of {limits.words()}"
    if len(text.encode("utf-8", "surrogatepass")) > limits.max_bytes:
        raise _refuse(error, field, shown_value, allowed, f"it has {len(text):,} characters")
    structure = sum(text.count(c) for c in ",=:[{-\n")
    if structure > 4 * limits.max_items + 64:  # every key or item costs one of these: refused before parsing
        raise _refuse(error, field, shown_value, allowed, f"about {structure:,} keys and items")
    if nesting_hint(text, fmt) > 2 * limits.max_depth:  # the parsers' cost grows with depth: refused before
        raise _refuse(error, field, shown_value, allowed, f"nested more than {limits.max_depth} levels")
    try:
        value = _PARSERS[fmt](text)
    except RecursionError:
        raise _refuse(error, field, shown_value, allowed, "nested too deep to parse") from None
    except _DuplicateKey as e:
        raise _refuse(error, field, shown_value, f"a {fmt.upper()} document naming each key once",
                      f"key {shown(e.key, 60)} is given twice; keep one") from None
    except ValueError as e:  # tomllib.TOMLDecodeError, json.JSONDecodeError and the int-digit limit are these
        raise _refuse(error, field, shown_value, f"a valid {fmt.upper()} document",
                      f"parse error: {shown(str(e), 160)}") from None
    except Exception as e:  # PyYAML's errors (no common base with the above)
        if type(e).__module__.startswith("yaml"):
            raise _refuse(error, field, shown_value, f"a valid {fmt.upper()} document",
                          f"parse error: {shown(' '.join(str(e).split()), 160)}") from None
        raise
    problem = check_value(value, limits)
    if problem:
        raise _refuse(error, field, shown_value, allowed, problem)
    return value


_TOKENS = re.compile(r"""[\[\]{}]|"(?:\\.|[^"\\\n])*"|'[^'\n]*'""")
_TOML_KEY = re.compile(r"^\s*(\[\[?[^\]]*|[^=\n]*=)", flags=re.MULTILINE)
_YAML_LINE = re.compile(r"^( *)((?:- +)*)", flags=re.MULTILINE)


def nesting_hint(text: str, fmt: str) -> int:
    """How deep ``text`` nests, read without parsing: brackets outside quoted strings, and per format the
    nesting a line can open without brackets (TOML's dotted keys and headers, YAML's indentation and ``- - -``).

    An estimate that errs high only on odd quoting, used to refuse before a parser whose time or memory grows
    with depth (PyYAML takes a minute on 2,000 nested ``[``; tomllib 1.5 GB on 20,000 dotted keys); the exact
    depth of what is parsed is :func:`check_value`'s."""
    depth = deepest = 0
    opening = text.count("[") + text.count("{")
    for m in _TOKENS.finditer(text) if opening > 8 else ():  # a few brackets cannot nest deep: not scanned
        c = m.group()
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth = max(0, depth - 1)
    if fmt == "toml":
        deepest = max([deepest] + [m.group(1).count(".") + 1 for m in _TOML_KEY.finditer(text)])
    elif fmt == "yaml":
        deepest = max([deepest] + [len(m.group(1)) // 2 + m.group(2).count("-") for m in _YAML_LINE.finditer(text)])
    return deepest


def check_value(value: Any, limits: Limits) -> str:
    """Why ``value`` (parsed) is past ``limits``, or ``""``; an integer's key path is named (``levers.seq_len``).
    Walks iteratively and stops at the first bound crossed, so a YAML alias bomb (a few hundred bytes naming
    the same list a billion times) costs little."""
    items, stack = 0, [(value, 1, "")]
    while stack:
        node, depth, where = stack.pop()
        if isinstance(node, dict):
            items += len(node)
            children = [(v, f"{where}.{k}" if where else str(k)) for k, v in node.items()]
        elif isinstance(node, (list, tuple)):
            items += len(node)
            children = [(v, f"{where}[{i}]") for i, v in enumerate(node)]
        else:
            if isinstance(node, int) and not isinstance(node, bool) and abs(node) > limits.max_int:
                what = (str(node) if abs(node) < 10**40 else f"an integer of "
                        f"{len(str(abs(node))) if abs(node) < 10**4000 else 'thousands of'} digits")
                return f"key {shown(where, 80)} holds {what}" if where else what
            continue
        if depth > limits.max_depth:
            return f"nested more than {limits.max_depth} levels"
        if items > limits.max_items:
            return f"more than {limits.max_items:,} keys and items"
        stack.extend((c, depth + 1, w) for c, w in children)
    return ""


class _DuplicateKey(Exception):
    def __init__(self, key: object) -> None:
        super().__init__(key)
        self.key = key


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _parse_json(text: str) -> Any:
    return json.loads(text, object_pairs_hook=_json_pairs)


def _parse_toml(text: str) -> Any:
    import tomllib  # TOML refuses a repeated key itself

    return tomllib.loads(text)


def _parse_yaml(text: str) -> Any:
    """PyYAML's safe load, refusing a mapping that names a key twice (PyYAML keeps the last silently)."""
    import yaml

    return yaml.load(text, Loader=_yaml_loader())  # a SafeLoader subclass: no arbitrary objects


@functools.cache
def _yaml_loader() -> type:
    """The safe loader (libyaml's scanner where PyYAML has it) whose mappings refuse a repeated key; built once."""
    import yaml

    class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        pass

    def mapping(loader: Any, node: Any, deep: bool = False) -> dict:
        loader.flatten_mapping(node)
        out: dict = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=deep)
            try:
                seen = key in out
            except TypeError:  # an unhashable key: PyYAML's own error says so
                return yaml.constructor.SafeConstructor.construct_mapping(loader, node, deep=deep)
            if seen:
                raise _DuplicateKey(key)
            out[key] = loader.construct_object(value_node, deep=deep)
        return out

    _Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return _Loader


_PARSERS: dict[str, Callable[[str], Any]] = {"toml": _parse_toml, "json": _parse_json, "yaml": _parse_yaml}


def _format_of(p: Path) -> str:
    suffix = p.suffix.lower()
    return {".toml": "toml", ".yaml": "yaml", ".yml": "yaml"}.get(suffix, "json")


# --------------------------------------------------------------------------------------------- writes, counts


def check_write_target(field: str, path: str | Path) -> Path:
    """A path trainfit may write a file to: absent, or an existing regular file (a named pipe, a device or a
    directory would block or be clobbered: refused naming ``field``)."""
    p = Path(path)
    try:
        info = os.stat(p)
    except FileNotFoundError:
        return p
    except NotADirectoryError:
        raise ConfigError(field, str(path), "a path in an existing directory",
                          f"its parent {_parent_file(p)} is a file, not a directory") from None
    except OSError as e:
        raise ConfigError(field, str(path), "a path trainfit can write a file to", e.strerror or type(e).__name__)
    if not stat.S_ISREG(info.st_mode):
        kind = ("a named pipe" if stat.S_ISFIFO(info.st_mode) else "a directory" if stat.S_ISDIR(info.st_mode)
                else "a device or socket")
        raise ConfigError(field, str(path), "a new file or an existing regular file", f"it is {kind}")
    return p


def _parent_file(p: Path) -> str:
    """The first ancestor of ``p`` that is a file (what makes ``p`` unreachable), for the message."""
    for parent in reversed(p.parents):
        if parent.is_file():
            return shown(str(parent), 120)
    return shown(str(p.parent), 120)


def max_processes() -> int:
    """The most processes trainfit starts on this machine for one job: four per CPU core this process may use
    (oversubscribed gloo ranks still run; past that, each one's threads and memory only stall the machine)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(4, 4 * cores)


def check_process_count(field: str, value: int, *, limit: int | None = None, what: str = "processes") -> int:
    """``value`` processes (or threads) to start: refused above what this machine can run (``limit``, by default
    :func:`max_processes`), naming ``field``."""
    limit = max_processes() if limit is None else limit
    if value > limit:
        raise ConfigError(field, value, f"at most {limit:,} {what} on this machine",
                          "each one is started here; give a count this machine can run")
    return value
