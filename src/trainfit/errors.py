"""User-facing errors: each names the field, the value, what is allowed and the fix.

The CLI turns any :class:`TrainfitError` into one line on stderr and exit code 2,
never a traceback. Internal invariants use ``assert``; user input never does.
"""

from __future__ import annotations

import enum
import reprlib
from collections.abc import Iterable

SHOWN_CHARS = 200
"""Longest echo of a user's value in a message (a 330-byte YAML file can expand to a 226 MB value)."""

LINE_CHARS = 1200
"""Longest error line the CLI prints (the value, what is allowed and the fix together)."""

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, SHOWN_CHARS, SHOWN_CHARS, SHOWN_CHARS
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 8


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` bounded to ``limit`` characters, without building the whole repr first (nested
    containers are cut at 3 levels and 8 items, long strings in the middle)."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int beyond Python's digit limit
        text = f"<{type(value).__name__} too large to print>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def one_line(message: str, limit: int = LINE_CHARS) -> str:
    """``message`` as one line of at most ``limit`` characters (line breaks become spaces)."""
    text = " ".join(message[:limit * 2].splitlines())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def refusal(field: str, value: object, allowed: str, fix: str = "") -> str:
    """The one wording of a refusal: ``field=value is not valid; allowed: ... (fix)``, the value cut by
    :func:`shown`; :class:`ConfigError` says it, and so does any error class the gate is asked to raise."""
    return f"{field}={shown(value)} is not valid; allowed: {allowed}" + (f" ({fix})" if fix else "")


class TrainfitError(Exception):
    """Base class for errors caused by user input (config, flags, model, checkpoint)."""


class ConfigError(TrainfitError, ValueError):
    """An invalid configuration value or flag."""

    def __init__(self, field: str, value: object, allowed: str | Iterable[str], fix: str = "") -> None:
        if not isinstance(allowed, str):
            allowed = "one of: " + ", ".join(str(a) for a in allowed)
        if isinstance(value, enum.Enum):  # a typed name reads as the name the user typed
            value = value.value
        super().__init__(refusal(field, value, allowed, fix))
        self.field = field
        self.value = value

    def __reduce__(self):
        """Pickled as its message, field and value, so a refusal crosses a process boundary (a pool worker, a
        spawned rank) as the same one line; unpickling a four-argument ``__init__`` from ``args`` would fail."""
        return _rebuilt, (type(self), str(self), self.field, self.value)


def _rebuilt(cls: type[ConfigError], message: str, field: str, value: object) -> ConfigError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.field, error.value = field, value
    return error


class CheckpointError(TrainfitError):
    """A checkpoint that is missing, corrupt, tampered with or from another program."""


class ModelError(TrainfitError):
    """A model spec that cannot be imported or built, or returns the wrong thing."""


class TrainingStopped(TrainfitError):
    """Training stopped on purpose (NaN loss, overflow storm); the last good checkpoint is kept."""


def check_choice(field: str, value: object, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(field, value, allowed)


def check_int(field: str, value: object, *, minimum: int, maximum: int | None = None, fix: str = "") -> None:
    """An integer >= ``minimum`` (and, when given, <= ``maximum``; ``fix`` says why the bound is there)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(field, value, f"an integer >= {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(field, value, f"an integer in [{minimum}, {maximum}]", fix)


def check_number(field: str, value: object, *, minimum: float, inclusive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:  # inf passes a comparison but is never a usable lr, scale or timeout; NaN fails it
        ok = (value >= minimum if inclusive else value > minimum) and value != float("inf")
    if not ok:
        op = ">=" if inclusive else ">"
        raise ConfigError(field, value, f"a finite number {op} {minimum}")


def check_unique_keys(field: str, spec: str) -> None:
    """``key=value,...`` naming each key once: a repeated key is refused (the last would silently win)."""
    seen: set[str] = set()
    for part in spec.split(","):
        key, eq, _ = (s.strip() for s in part.partition("="))
        if eq and key in seen:
            raise ConfigError(f"{field}.{key}", spec, "each key once", f"{key} is given twice; keep one")
        seen.add(key)


def check_patterns(field: str, spec: str) -> None:
    """Comma-separated patterns, none empty (``--freeze ','`` would freeze nothing and say nothing)."""
    if spec and any(not p.strip() for p in spec.split(",")):
        raise ConfigError(field, spec, "comma-separated non-empty patterns", "drop the empty one (',,' or an "
                          "end comma)" if spec.strip(", ") else "give a pattern, or leave the option out")
