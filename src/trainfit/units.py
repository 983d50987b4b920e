"""Bytes in and out: the one parser (``24GiB``) and the one formatter (``1.50 GiB``). Pure."""

from __future__ import annotations

import re
from fractions import Fraction

from trainfit.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MAX_BYTES = 2**64
"""The largest size taken (16 EiB, a 64-bit address space): larger ones are typos, and their byte counts
would overflow the floats the planner and meters compute with."""
_TOO_LARGE = "the largest size taken is 16 EiB = 2**64 bytes"
SIZE_ALLOWED = "a size of at least 1 byte such as 80GiB, 24GB or 512MiB"
"""What a size field allows, in the words every refusal uses."""


def parse_bytes(field_name: str, text: str | int, *, allowed: str = SIZE_ALLOWED) -> int:
    """Parse ``24GiB``, ``80GB``, ``512MiB``, ``1.5GiB`` or a plain integer into whole bytes.

    The number is read exactly (``4.35MB`` is 4,350,000 bytes, any number of digits, no float
    rounding or overflow) and rounded down to whole bytes; a size under 1 byte after that (``0.5``,
    ``0.5B``, ``0``) or over :data:`MAX_BYTES` is refused naming ``field_name`` -- the user's flag or
    key -- and the text typed.
    ``allowed`` words the refusal for sizes that are not plain sizes (a bandwidth: ``450GB/s``)."""
    if isinstance(text, bool):
        raise ConfigError(field_name, text, allowed)
    if isinstance(text, int):
        return _in_range(field_name, text, text, allowed)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text), flags=re.ASCII)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(field_name, text, allowed)
    if len(m.group(1).lstrip("0")) > 40:  # past any unit's 2**64 bytes; spares Fraction a huge number
        raise ConfigError(field_name, text, allowed, _TOO_LARGE)
    exact = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]
    if 0 < exact < 1:
        raise ConfigError(field_name, text, allowed, "sizes are whole bytes; this one rounds down to 0")
    return _in_range(field_name, text, int(exact), allowed)  # floor to whole bytes


def _in_range(field_name: str, text: object, n: int, allowed: str) -> int:
    if n < 1:
        raise ConfigError(field_name, text, allowed)
    if n > MAX_BYTES:
        raise ConfigError(field_name, text, allowed, _TOO_LARGE)
    return n


def fmt_bytes(n: float) -> str:
    """Binary units, 3 significant figures: 1.50 GiB; from 1,000 of a unit up, whole units with thousands
    separators (1,000 MiB, 2,048 TiB), never ``1e+03``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            v = n / size
            text = f"{v:.3g}"
            return f"{v:,.0f} {unit}" if "e" in text else f"{text} {unit}"
    return f"{int(n)} B"
