"""Bytes in and out: the one parser (``24GiB``) and the one formatter (``1.50 GiB``). Pure."""

from __future__ import annotations

import re

from trainfit.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(field_name: str, text: str | int) -> int:
    """Parse ``24GiB``, ``80GB``, ``512MiB`` or a plain integer into bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ConfigError(field_name, text, "a positive size such as 24GiB, 80GB or 512MiB")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(field_name, text, "a positive size such as 24GiB, 80GB or 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    """Binary units, 3 significant figures: 1.50 GiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"
