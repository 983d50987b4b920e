"""User-facing errors: each names the field, the value, what is allowed and the fix.

The CLI turns any :class:`TrainfitError` into one line on stderr and exit code 2,
never a traceback. Internal invariants use ``assert``; user input never does.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class TrainfitError(Exception):
    """Base class for errors caused by user input (config, flags, model, checkpoint)."""


class ConfigError(TrainfitError, ValueError):
    """An invalid configuration value or flag."""

    def __init__(self, field: str, value: object, allowed: str | Iterable[str], fix: str = "") -> None:
        if not isinstance(allowed, str):
            allowed = "one of: " + ", ".join(str(a) for a in allowed)
        if isinstance(value, enum.Enum):  # a typed name reads as the name the user typed
            value = value.value
        msg = f"{field}={value!r} is not valid; allowed: {allowed}"
        if fix:
            msg += f" ({fix})"
        super().__init__(msg)
        self.field = field
        self.value = value


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
