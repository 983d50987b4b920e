"""Numbers for people (pure): thousands separators and units, never ``1.364e+04``.

Every number the report shows, in its tables and on its charts' axes and bars, goes through these:

>>> fmt_num(13640.0), fmt_num(5.51012), fmt_num(0.0061), fmt_num(65536)
('13,640', '5.51', '0.0061', '65,536')
>>> fmt_ms(13.64), fmt_seconds(13.64), fmt_seconds(0.238), fmt_rate(1111.4, "tokens")
('13,640 ms', '13.6 s', '238 ms', '1,111 tokens/s')

Numbers too small for three significant decimals (below 0.001) or too large for a row of digits (10**15 and
up) are written with a power of ten in superscript (``6.1 × 10⁻⁶``), never in a program's ``e`` notation.
"""

from __future__ import annotations

import math

_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")
SMALLEST_PLAIN = 1e-3
"""Below this (and above 0) a number gets a power of ten: 0.0000061 is hard to read."""
LARGEST_PLAIN = 1e15
"""From this up a number gets a power of ten: a row of 16 digits is hard to read."""


def fmt_num(x: float | int | None, digits: int = 3) -> str:
    """``x`` with thousands separators and ``digits`` significant figures (whole numbers keep every digit):
    13640.0 -> "13,640", 5.51012 -> "5.51", 0.25 -> "0.25", 65536 -> "65,536"; NaN -> "NaN", None -> "-"."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}" if abs(x) < LARGEST_PLAIN else _power(float(x), digits)
    try:
        x = float(x)
    except (TypeError, ValueError, OverflowError):
        return str(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    if x == 0:
        return "0"
    if abs(x) >= LARGEST_PLAIN or abs(x) < SMALLEST_PLAIN:
        return _power(x, digits)
    places = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    text = f"{x:,.{places}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _power(x: float, digits: int) -> str:
    """``x`` as mantissa × 10 to a superscript power: 6.1e-06 -> "6.1 × 10⁻⁶"."""
    exp = math.floor(math.log10(abs(x)))
    mant = x / 10.0**exp
    if round(abs(mant), digits - 1) >= 10:  # 9.996 rounds up to 10.0: one more power
        exp, mant = exp + 1, mant / 10
    m = f"{mant:.{max(0, digits - 1)}f}".rstrip("0").rstrip(".")
    return f"{m} × 10{str(exp).translate(_SUPERSCRIPT)}"


def fmt_ms(seconds: float | None) -> str:
    """Seconds as milliseconds with thousands separators: 13.64 -> "13,640 ms" (one unit, so bars and rows of
    one table read against each other)."""
    if seconds is None:
        return "-"
    return f"{fmt_num(seconds * 1e3)} ms"


def fmt_seconds(seconds: float | None) -> str:
    """A duration in the unit that reads best: 0.238 -> "238 ms", 13.64 -> "13.6 s", 5400 -> "5,400 s"."""
    if seconds is None:
        return "-"
    try:
        s = float(seconds)
    except (TypeError, ValueError, OverflowError):
        return str(seconds)
    if math.isfinite(s) and 0 < abs(s) < 1:
        return fmt_ms(s)
    return f"{fmt_num(s)} s"


def fmt_rate(per_s: float | None, unit: str) -> str:
    """A throughput: 1111.4 tokens -> "1,111 tokens/s" (whole units from 1,000 up)."""
    if per_s is None:
        return "-"
    return f"{fmt_num(per_s, digits=4)} {unit}/s"


def fmt_share(frac: float | None) -> str:
    """A fraction as a percentage: 0.33 -> "33%", 0.0042 -> "0.42%"."""
    if frac is None:
        return "-"
    try:
        f = float(frac) * 100
    except (TypeError, ValueError, OverflowError):
        return str(frac)
    if not math.isfinite(f):
        return fmt_num(f)
    return f"{fmt_num(f, digits=2) if abs(f) < 10 else fmt_num(round(f))}%"


def tick_formatter(unit: str = ""):
    """A matplotlib ``FuncFormatter`` writing axis ticks with :func:`fmt_num` (and ``unit``)."""
    from matplotlib.ticker import FuncFormatter  # drawn only with matplotlib loaded (plots.py loads it lazily)

    suffix = f" {unit}" if unit else ""
    return FuncFormatter(lambda x, _pos: fmt_num(x, digits=4) + suffix)
