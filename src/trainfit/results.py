"""The typed results of the probes (pure): memory, profile, plan and verify reports.

Each report is a frozen dataclass whose ``to_dict()`` is the JSON object its command prints with
``--json`` (and stores with ``--report``), and whose ``from_dict(d)`` rebuilds it from such an object:
keys it does not know are kept in ``extra`` (and written back by ``to_dict``), optional keys that are
missing take their defaults, and anything else that does not fit raises :class:`ResultFormatError`.
``trainfit report`` reads the stored files through these classes only.
"""

from __future__ import annotations

import dataclasses
import html
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainfit.units import fmt_bytes
from trainfit.vocabulary import PART_LABELS, PARTS, PrecisionName, Tolerance, precision_facts

# Which lever targets which part (one table; the planner has the full compatibility rules).
LEVERS: dict[str, str] = {
    "params": "store weights in half precision (--precision bf16-true) or shard them (--strategy zero3)",
    "grads": "shard gradients (--strategy zero2/zero3) or use half-precision weights (bf16-true)",
    "optimizer": "shard optimizer state (--strategy zero1/zero2/zero3) or use a stateless optimizer (sgd)",
    "activations": "activation checkpointing (--checkpointing full) or a smaller micro-batch with accumulation",
    "temporaries": "a smaller micro-batch (temporaries scale with it) or a shorter sequence",
}


class ResultFormatError(ValueError):
    """A stored result that is not the object its class writes (a key missing, a value of the wrong type)."""


_INT_LIMIT = 2**63
"""Stored integers (bytes, counts, steps) are 64-bit: a larger one is not a count any probe wrote."""
_FLOAT_MAX = 1.7976931348623157e308


def _short(v: object, limit: int = 60) -> str:
    """``repr(v)`` cut to ``limit`` characters (an error message quotes the value, not a whole file)."""
    try:
        r = repr(v)
    except (RecursionError, ValueError):  # nested too deeply; an int too long to print
        r = f"<{type(v).__name__}>"
    return _cut(r, limit)


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- from_dict machinery: one reader for every report, driven by the fields' annotations --------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _object(cls: type, d: object) -> dict[str, Any]:
    if not isinstance(d, Mapping):
        raise ResultFormatError(f"{cls.__name__}: expected a JSON object, got {type(d).__name__}")
    if not all(isinstance(k, str) for k in d):
        raise ResultFormatError(f"{cls.__name__}: expected an object with text keys, got {_short(d)}")
    return dict(d)


def _coerce(hint: Any, v: Any, where: str) -> Any:
    """``v`` checked against ``hint`` and turned into the field's type (lists -> tuples, objects -> classes)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        try:
            return _plain(v)
        except RecursionError:
            raise ResultFormatError(f"{where}: nested too deeply") from None
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        errors = []
        for a in (a for a in args if a is not type(None)):
            try:
                return _coerce(a, v, where)
            except ResultFormatError as e:
                errors.append(str(e))
        raise ResultFormatError(errors[0] if len(errors) == 1 else f"{where}: {_short(v)} is none of {hint}")
    if hint is bool:
        ok = isinstance(v, bool)
    elif hint is int:
        ok = isinstance(v, int) and not isinstance(v, bool) and -_INT_LIMIT <= v < _INT_LIMIT
    elif hint is float:  # NaN and infinity are floats (a diverged run's figures); an int too big for one is not
        ok = isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool) and abs(v) <= _FLOAT_MAX)
    elif hint is str:
        ok = isinstance(v, str)
    elif origin is Mapping or hint is Mapping or origin is dict:
        if not isinstance(v, Mapping):
            raise ResultFormatError(f"{where}: expected an object, got {_short(v)}")
        key_t, val_t = args or (str, Any)
        return {_coerce(key_t, k, where): _coerce(val_t, x, f"{where}.{k}") for k, x in v.items()}
    elif origin is tuple:
        if not isinstance(v, (list, tuple)):
            raise ResultFormatError(f"{where}: expected a list, got {_short(v)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], x, f"{where}[{i}]") for i, x in enumerate(v))
        if len(v) != len(args):
            raise ResultFormatError(f"{where}: expected {len(args)} items, got {_short(v)}")
        return tuple(_coerce(a, x, f"{where}[{i}]") for i, (a, x) in enumerate(zip(args, v)))
    elif dataclasses.is_dataclass(hint):
        if isinstance(v, hint):
            return v
        reader = getattr(hint, "from_dict", None)
        return reader(v) if reader is not None else _build(hint, _object(hint, v))
    else:  # pragma: no cover - a field annotated with a type this reader does not know
        raise TypeError(f"{where}: no reader for {hint!r}")
    if not ok:
        raise ResultFormatError(f"{where}: expected {hint.__name__}, got {_short(v)}")
    return v


def _build(cls: type, d: dict[str, Any]):
    """``cls(**d)`` with every value checked; unknown keys go to the ``extra`` field (an error without one)."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    has_extra = "extra" in fields
    # A stored key named "extra" is itself an unknown key: kept inside extra, not taken for the field.
    extra = {k: v for k, v in d.items() if k not in fields or k == "extra"}
    if extra and not has_extra:
        raise ResultFormatError(_cut(f"{cls.__name__}: unknown key(s) {', '.join(sorted(extra))}"))
    missing = [n for n, f in fields.items() if n not in d and n != "extra"
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ResultFormatError(f"{cls.__name__}: missing {', '.join(missing)}")
    hints = _hints(cls)
    kw = {n: _coerce(hints[n], d[n], f"{cls.__name__}.{n}") for n in fields if n in d and n != "extra"}
    if has_extra:
        kw["extra"] = extra
    try:
        return cls(**kw)
    except (TypeError, ValueError, OverflowError, AssertionError) as e:
        raise ResultFormatError(_cut(f"{cls.__name__}: {e}")) from e


def _with_extra(d: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``d`` followed by the unknown keys a report was read with (never over a known key)."""
    d.update({k: v for k, v in extra.items() if k not in d})
    return d


def _plain(v: Any) -> Any:
    """``v`` as JSON sees it: reports as their ``to_dict``, tuples as lists, mappings as dicts."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        to_dict = getattr(v, "to_dict", None)
        return to_dict() if to_dict is not None else {f.name: _plain(getattr(v, f.name))
                                                        for f in dataclasses.fields(v)}
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


# -- rendering: a plain-text table (str) and a small HTML table (notebooks), generic over the fields ----------

def _cell(name: str, v: Any) -> str:
    """One value as the tables show it: bytes with their unit and exact count, numbers to 6 significant digits."""
    if v is None:
        return "-"
    if isinstance(v, bool) or isinstance(v, str):
        return str(v)
    if isinstance(v, int):
        return f"{fmt_bytes(v)} ({v:,} B)" if name.endswith(("_bytes", "_bytes_per_device")) and v >= 0 else f"{v:,}"
    if isinstance(v, float):
        return f"{v:.6g}"
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _cut(", ".join(f"{f.name}={_cell(f.name, getattr(v, f.name))}" for f in dataclasses.fields(v)), 120)
    if isinstance(v, Mapping):
        return _cut(", ".join(f"{k}={_cell(str(k), x) if not isinstance(x, Mapping) else '{...}'}"
                              for k, x in v.items()), 120)
    if isinstance(v, (list, tuple)):  # pairs (a module and its bytes) as "name value"
        return _cut(", ".join(" ".join(_cell(name, y) for y in x) if isinstance(x, (list, tuple)) else
                              _cell(name, x) for x in v), 120)
    return _cut(str(v), 120)


def _is_rows(v: Any) -> bool:
    """A tuple of reports (a plan's rows, a profile's advice): shown as a table of its own."""
    return isinstance(v, tuple) and bool(v) and all(isinstance(x, _Typed) for x in v)


def _row_columns(rows: tuple) -> list[str]:
    """The columns of a sub-table: the rows' fields that hold one value (not mappings, lists or ``extra``)."""
    return [f.name for f in dataclasses.fields(rows[0])
            if f.name != "extra" and not isinstance(getattr(rows[0], f.name), (Mapping, tuple, list))]


def render_parts(report: Any) -> tuple[str, list[tuple[str, str]], list[tuple[str, list[str], list[list[str]]]]]:
    """(title, [(field, value)], [(field, columns, rows)]) of a report dataclass: every field that is set (empty
    mappings and tuples left out), the scalar keys of ``extra`` too, and each tuple of reports as a table."""
    title = type(report).__name__ + (f": {report.model}" if getattr(report, "model", "") else "")
    pairs: list[tuple[str, str]] = []
    tables = []
    values = [(f.name, getattr(report, f.name)) for f in dataclasses.fields(report) if f.name != "extra"]
    values += [(k, v) for k, v in getattr(report, "extra", {}).items() if not isinstance(v, (Mapping, list))]
    for name, v in values:
        if _is_rows(v):
            cols = _row_columns(v)
            tables.append((name, cols, [[_cell(c, getattr(r, c)) for c in cols] for r in v]))
        elif not (isinstance(v, (Mapping, tuple, list, str)) and not v):
            pairs.append((name, _cell(name, v)))
    return title, pairs, tables


def render_text(report: Any) -> str:
    """The plain-text table of a report: one ``field  value`` line each, then its sub-tables."""
    title, pairs, tables = render_parts(report)
    width = max((len(n) for n, _ in pairs), default=0) + 2
    lines = [title, *(f"  {n:<{width}}{v}" for n, v in pairs)]
    for name, cols, rows in tables:
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        lines.append(f"{name}:")
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
        lines += ["  " + "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def render_html(report: Any) -> str:
    """A small HTML table of a report (every text escaped with ``html.escape``), for notebooks."""
    title, pairs, tables = render_parts(report)
    esc = html.escape
    out = [f"<div class=\"trainfit-report\"><b>{esc(title)}</b>", "<table>"]
    out += [f"<tr><th style=\"text-align:left\">{esc(n)}</th><td>{esc(v)}</td></tr>" for n, v in pairs]
    out.append("</table>")
    for name, cols, rows in tables:
        out.append(f"<p><b>{esc(name)}</b></p><table>")
        out.append("<tr>" + "".join(f"<th>{esc(c)}</th>" for c in cols) + "</tr>")
        out += ["<tr>" + "".join(f"<td>{esc(x)}</td>" for x in r) + "</tr>" for r in rows]
        out.append("</table>")
    out.append("</div>")
    return "\n".join(out)


class _Typed:
    """Shared by the reports: fields checked and normalised when built; ``to_dict``/``from_dict`` by field; a
    plain-text table as ``str()`` and an HTML table for notebooks (``_repr_html_``)."""

    def __str__(self) -> str:
        return render_text(self)

    def _repr_html_(self) -> str:
        return render_html(self)

    def __post_init__(self) -> None:
        # Lists become tuples and nested objects their classes, so a report built by a probe equals
        # the same report read back from its JSON.
        for f in dataclasses.fields(self):
            where = f"{type(self).__name__}.{f.name}"
            object.__setattr__(self, f.name, _coerce(_hints(type(self))[f.name], getattr(self, f.name), where))

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"}
        return _with_extra(d, getattr(self, "extra", {}))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        """The report ``to_dict`` wrote; unknown keys kept in ``extra``.

        Raises:
            ResultFormatError: ``d`` is not this kind of report.
        """
        return _build(cls, _object(cls, d))


@dataclass(frozen=True, kw_only=True)
class MemoryReport(_Typed):
    """What fills memory during one optimizer step (the second, so optimizer state exists).

    The part fields are each part's *largest* live bytes during the step; ``peak_parts``
    splits ``peak_bytes`` at the moment of the peak (its values sum to ``peak_bytes``).
    """

    method: str
    """"measured" (real tensors) or "estimated" (fake tensors, nothing allocated)."""
    model: str
    precision: str
    checkpointing: str
    optimizer: str
    batch: int
    """Samples in the micro-batch."""
    seq_len: int
    accumulation: int
    n_params: int
    """Parameters of the model (shared ones once)."""
    params_bytes: int
    """Parameters and buffers, as stored (fp32 under bf16-mixed; half under bf16-true)."""
    grads_bytes: int
    """Gradients, including the fp32 gradients of master weights."""
    optimizer_bytes: int
    """Optimizer state (e.g. Adam's two moments) plus fp32 master weights where the precision keeps them."""
    master_weights_bytes: int
    """The fp32 master copy alone (part of optimizer_bytes; 0 unless bf16-true/fp16-true)."""
    activations_bytes: int
    """Tensors saved for backward, at their largest (end of forward, usually)."""
    temporaries_bytes: int
    """Everything else live at the peak: op outputs not saved, the batch, the loss, scratch."""
    peak_bytes: int
    peak_phase: str
    """forward, backward or optimizer."""
    peak_parts: Mapping[str, int]
    """The split of peak_bytes by part at the moment of the peak."""
    phases: Mapping[str, Mapping[str, int]]
    """Per phase: its peak ("peak") and the split by part at that moment."""
    top_modules: tuple[tuple[str, int], ...]
    """Modules by activation bytes saved in their own forward (repeated blocks folded to ``*``)."""
    notes: tuple[str, ...] = ()
    device_max_allocated_bytes: int | None = None
    """torch.cuda.max_memory_allocated over the measured step (None off GPU or when estimated)."""
    device_max_reserved_bytes: int | None = None
    wall_s: float = 0.0
    """Seconds to produce this report."""
    details: Mapping[str, Any] = field(default_factory=dict)
    """How the numbers were obtained (e.g. the block shortcut: traced layer counts)."""
    strategy: str = ""
    """The strategy measured (or, estimated, sharded for); empty in reports stored before this key existed."""
    world_size: int = 0
    """Ranks the strategy spread over (per-rank bytes); 0 in reports stored before this key existed."""
    host_bytes: Mapping[str, int] = field(default_factory=dict)
    """Per part, its largest live bytes in host memory (``--offload``); empty: everything on the device."""
    device_bytes: Mapping[str, int] = field(default_factory=dict)
    """Per part, its largest live bytes on the device; empty: the part fields (nothing on the host)."""
    device_peak_bytes: int | None = None
    """Largest live device bytes (what must fit the device); None: peak_bytes (nothing on the host)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Keys of a stored report that this class does not know (written back as they were)."""

    @property
    def device_peak(self) -> int:
        """What must fit in device memory: the device side's peak (``peak_bytes`` with nothing offloaded)."""
        return self.peak_bytes if self.device_peak_bytes is None else self.device_peak_bytes

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                     "temporaries_bytes", "peak_bytes", "n_params", "master_weights_bytes"):
            assert getattr(self, name) >= 0, (name, getattr(self, name))

    @property
    def parts(self) -> dict[str, int]:
        return {p: getattr(self, f"{p}_bytes") for p in PARTS}

    @property
    def dominant_part(self) -> str:
        """The part holding the most bytes at the peak."""
        return max(PARTS, key=lambda p: self.peak_parts.get(p, 0))

    @property
    def lever_line(self) -> str:
        part = self.dominant_part
        share = self.peak_parts.get(part, 0) / max(self.peak_bytes, 1)
        return f"largest part at the peak: {PART_LABELS[part]} ({share:.0%}); lever: {LEVERS[part]}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        del d["extra"]
        d["peak_parts"] = dict(self.peak_parts)
        d["phases"] = {k: dict(v) for k, v in self.phases.items()}
        d["top_modules"] = [{"module": n, "activations_bytes": b} for n, b in self.top_modules]
        d["notes"] = list(self.notes)
        d["dominant_part"] = self.dominant_part
        d["lever"] = LEVERS[self.dominant_part]
        d["host_bytes"], d["device_bytes"] = dict(self.host_bytes), dict(self.device_bytes)
        for key in ("strategy", "world_size", "host_bytes", "device_bytes"):  # a report stored before these keys
            if not d[key]:                                                     # reads back to the same JSON
                del d[key]
        if d["device_peak_bytes"] is None:
            del d["device_peak_bytes"]
        return _with_extra(d, self.extra)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MemoryReport:
        """The report ``to_dict`` wrote (``dominant_part`` and ``lever`` are recomputed, not read).

        Raises:
            ResultFormatError: ``d`` is not a memory report.
        """
        d = _object(cls, d)
        for derived in ("dominant_part", "lever"):
            d.pop(derived, None)
        if "top_modules" in d:
            rows = _coerce(tuple[Mapping[str, Any], ...], d["top_modules"], "MemoryReport.top_modules")
            try:
                d["top_modules"] = [(r["module"], r["activations_bytes"]) for r in rows]
            except KeyError as e:
                raise ResultFormatError(f"MemoryReport.top_modules: an entry without {e}") from None
        return _build(cls, d)


def precision_notes(precision: str, n_params: int, params_bytes: int, master_bytes: int) -> tuple[str, ...]:
    """Say in words what the precision did to parameter memory (measured, not assumed)."""
    if n_params == 0:
        return ()
    per = params_bytes / n_params
    facts = precision_facts(precision)
    if facts.autocast:
        return (f"{precision}: weights stay fp32 under autocast ({per:.2f} B/param), so parameter memory is "
                f"NOT halved; only activations shrink. Use {PrecisionName.BF16_TRUE} to halve weights.",)
    if facts.master_copy:
        return (f"{precision}: weights stored in half precision ({per:.2f} B/param, parameter memory halved), "
                f"but the fp32 master copy adds {fmt_bytes(master_bytes)} "
                f"({master_bytes / n_params:.2f} B/param) to optimizer state.",)
    return ()


def fold_block_name(name: str, block_names: list[str]) -> str:
    """``layers.3.mlp`` -> ``layers.*.mlp`` when ``layers.3`` is a repeated block."""
    for b in block_names:
        if name == b or name.startswith(b + "."):
            head, _, idx = b.rpartition(".")
            if idx.isdigit():
                return (head + "." if head else "") + "*" + name[len(b):]
    return name


def fold_modules(per_module: Mapping[str, int], block_names: list[str], top: int = 10) -> tuple[tuple[str, int], ...]:
    folded: dict[str, int] = {}
    for name, b in per_module.items():
        key = fold_block_name(name, block_names)
        folded[key] = folded.get(key, 0) + b
    ranked = sorted(folded.items(), key=lambda kv: (-kv[1], kv[0]))
    return tuple(ranked[:top])


# -- profile ---------------------------------------------------------------------------------------------------

TIME_PHASES = ("data_wait", "h2d", "forward", "backward", "comm_exposed", "optimizer", "rest")
"""The phases a profile splits a step into (``<phase>_s`` fields), in step order."""


@dataclass(frozen=True, kw_only=True)
class Advice(_Typed):
    """One piece of profile advice: its kind, the sentence, and the measured figures behind it."""

    kind: str
    """input, batch, communication or scale-out."""
    text: str
    figures: Mapping[str, Any] = field(default_factory=dict)
    """The numbers the advice rests on (e.g. ``data_wait_frac``, the suggested ``micro_batch``)."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "text": self.text, **{k: v for k, v in self.figures.items()
                                                         if k not in ("kind", "text")}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Advice:
        d = _object(cls, d)
        try:
            kind, text = d.pop("kind"), d.pop("text")
        except KeyError as e:
            raise ResultFormatError(f"Advice: missing {e}") from None
        return _build(cls, {"kind": kind, "text": text, "figures": d})


@dataclass(frozen=True, kw_only=True)
class BatchProbe(_Typed):
    """Whether throughput still rises at twice the micro-batch, and the micro-batch suggested."""

    micro_batch: int
    """The profiled micro-batch (the probe ran it against twice as many)."""
    gain: float | None
    """Relative throughput gain at 2x micro-batch; None when not probed or out of memory."""
    rates_per_s: tuple[float, float] | None
    """Median throughput (items/s) at micro_batch and 2x micro_batch."""
    note: str
    suggested_micro_batch: int | None = None
    fit: str = ""
    """How the suggestion was found to fit (memory report) or why none was."""
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ProfileReport(_Typed):
    """Where each optimizer step's time goes (medians per device over the profiled steps), and what to do.

    The fields are the keys of ``trainfit profile --json`` in its order; the configuration it was
    measured on is ``model``, ``precision``, ``checkpointing``, ``accumulation``, ``strategy``,
    ``world_size``, ``rank`` and ``micro_batch`` (from the batch probe).
    """

    data_wait_frac: float
    """Share of the total step time blocked on the loader."""
    data_wait_s: float
    h2d_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    comm_exposed_s: float
    rest_s: float
    step_s: float
    """Median seconds per optimizer step, and per phase (the phases' medians need not add up to it)."""
    busy_frac: float
    """Device busy share (CUDA kernel timeline) or, on CPU, the share of the step spent computing."""
    tokens_per_s: float | None = None
    """Per device; None when the task counts samples."""
    samples_per_s: float
    mfu: float | None = None
    hfu: float | None = None
    bottleneck: str
    advice: tuple[Advice, ...] = ()
    """Ordered: the first is the one to act on first."""
    unit: str
    """What the task counts: tokens or samples."""
    per_device: bool = True
    parts: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """Per phase key (``forward_s``...): median, p25, p75, min, max over the steps."""
    fractions: Mapping[str, float] = field(default_factory=dict)
    """Per phase key: its share of the total step time."""
    model_flops_per_step: float | None = None
    hardware_flops_per_step: float | None = None
    flops_counted_on: str = ""
    flops_steps: int = 0
    peak_flops: float | None = None
    peak_dtype: str = ""
    peak_source: str = ""
    batch_probe: BatchProbe
    scaling: Mapping[str, Any] = field(default_factory=dict)
    """Predicted scale-out curves per strategy (``trainfit.probes.scaleout.scaling``)."""
    precision_probe: Mapping[str, float] = field(default_factory=dict)
    """Median step seconds per precision (the profiled one and each that needs no more memory), measured
    side by side on this device (``trainfit.probes.profile.probe_precision``); empty when not probed."""
    precision_probe_note: str = ""
    """How the precision probe measured, or why it did not."""
    grad_sync_separable: bool = True
    device: str
    world_size: int
    rank: int
    strategy: str
    steps: int
    warmup: int
    trace: str | None = None
    threads: int | None = None
    model: str = ""
    precision: str = ""
    """The configuration profiled (with strategy, world_size and the batch probe's micro_batch); empty in
    profiles stored before these keys existed."""
    checkpointing: str = ""
    accumulation: int = 0
    compile_s: float | None = None
    """``--compile``: the first (compiling) step's seconds less the median step -- compile cost, apart from
    ``step_s``, which the warm-up and timed steps measure after it; None without ``--compile``."""
    compile_graphs: int | None = None
    """``--compile``: graphs compiled in the first step, and ``recompiles`` those in the timed steps after it."""
    recompiles: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def micro_batch(self) -> int:
        return self.batch_probe.micro_batch

    @property
    def phases(self) -> dict[str, float]:
        """Median seconds per phase, without the ``_s`` (data_wait ... rest), in step order."""
        return {p: getattr(self, f"{p}_s") for p in TIME_PHASES}

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        # A profile stored before the precision probe existed (neither key) reads back to the same JSON.
        if not self.precision_probe and not self.precision_probe_note:
            del d["precision_probe"], d["precision_probe_note"]
        if self.compile_s is None:  # --compile's keys only when it was on (older profiles read back the same)
            del d["compile_s"], d["compile_graphs"], d["recompiles"]
        return d



# -- plan ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class PlanRow(_Typed):
    """One ranked configuration of ``trainfit plan``: the levers, what it costs, and why it ranks there."""

    precision: str
    micro_batch: int
    accumulation: int
    checkpointing: str
    strategy: str
    peak_bytes_per_device: int
    step_s: float
    scaling_efficiency: float
    fits: bool
    reasons: tuple[str, ...]
    """Why it was dropped, or why it ranks where it does."""
    grad_sync: str
    parts: Mapping[str, int] = field(default_factory=dict)
    """Predicted bytes per device by part."""
    compute_s: float = 0.0
    exposed_comm_s: float = 0.0
    compile: bool = False
    """Compiled per block (``--compile on``); priced at a measured or given speed-up."""
    offload: str = ""
    """``--offload`` parts ("" none), priced at the device's host link."""
    offload_s: float = 0.0
    """Seconds of the step spent on offload's host copies (not overlapped: an upper bound)."""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = super().to_dict()
        for key in ("compile", "offload", "offload_s"):  # said only when on: plans without them read back the same
            if not d.get(key):
                d.pop(key, None)
        return d


@dataclass(frozen=True, kw_only=True)
class PlanReport(_Typed):
    """``trainfit plan --json``: the job planned for and its ranked configurations (best first)."""

    model: str
    global_batch: int
    """Samples per optimizer step over all devices."""
    devices: int
    device_memory_bytes: int
    basis: str
    """Where the memory parts came from: analytic, estimate or measure."""
    candidates: int
    """Configurations considered."""
    excluded: Mapping[str, int] = field(default_factory=dict)
    """Rule -> how many candidates it excluded."""
    notes: tuple[str, ...] = ()
    plans: tuple[PlanRow, ...]
    """The ones shown: fitting ones fastest first, then those that do not fit."""
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> PlanRow | None:
        return self.plans[0] if self.plans and self.plans[0].fits else None


# -- verify ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class VerifyReport(_Typed):
    """One step of the configured levers against the fp32 big-batch reference."""

    precision: str
    strategy: str
    micro_batch: int
    accumulation: int
    world_size: int
    global_batch: int
    grad_cosine: float
    grad_rel_error: float
    grad_norm_ratio: float
    """||g|| / ||g_ref||: 1 when correct; the loss scale when never unscaled."""
    update_max_rel_error: float
    skipped_steps: int
    fp16_underflow_frac: float
    """Non-zero reference gradient values that become 0 when cast to fp16 (no loss scaling)."""
    loss_scale: float
    tolerance: Tolerance
    passed: bool
    causes: tuple[str, ...] = ()
    """Why it failed, most likely first (empty when it passed)."""
    checkpointing: str = ""
    """The checkpointing policy verified; empty in reports stored before this key existed."""
    compiled: bool = False
    """The run under test was compiled (``--compile``; the reference is always eager fp32)."""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if not self.checkpointing:  # a report stored before the key existed reads back to the same JSON
            del d["checkpointing"]
        if not self.compiled:  # only said when it was (reports without it read back the same)
            del d["compiled"]
        return d


# -- train -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class TrainSummary(_Typed):
    """What ``trainfit train --json`` prints: the run's length, its first and final loss, its rate.

    What the training loop returns (``trainfit.train.train``; ``trainfit.train.Summary`` is this class) and the
    front door's ``train()`` passes on.
    """

    steps: int
    final_loss: float
    first_loss: float
    skipped_steps: int
    items_per_s: float
    """Loss-bearing items per second over the run: tokens for token tasks, samples for sample tasks (``unit``)."""
    effective_batch: int
    unit: str
    """What an item is: "tokens" or "samples"."""
    run_dir: str
    wall_s: float
    val_loss: float | None = None
    """Token-weighted validation loss at the last evaluation (None without ``eval_every``)."""
    val_perplexity: float | None = None
    """exp(val_loss)."""
    model_dir: str | None = None
    """Where the model was exported at the end (None when nothing was exported)."""
    compile_s: float | None = None
    """``--compile``: wall seconds of the steps that compiled graphs, less a steady step each -- the compile
    cost, kept apart from step time (``items_per_s`` still counts the whole wall time); None without it."""
    compile: Mapping[str, Any] | None = None
    """``--compile``: what was compiled (scope, targets, backend, mode), ``graphs`` compiled by this run and
    ``recompiles_after_first_step`` (0 expected: shapes are symbolic); None without it."""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` summary; the rate also under ``<unit>_per_s`` (``tokens_per_s`` or ``samples_per_s``)."""
        d = super().to_dict()
        d[f"{self.unit}_per_s"] = self.items_per_s
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainSummary:
        d = _object(cls, d)
        d.pop(f"{d.get('unit')}_per_s", None)  # derived from items_per_s
        return _build(cls, d)


# -- prepare ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class PrepareReport(_Typed):
    """What ``trainfit prepare`` wrote: ``trainfit prepare --json`` (less ``removed_stale``)."""

    out: str
    """The prepared directory (``train --data OUT`` reads it)."""
    n_documents: int
    n_tokens: int
    """Tokens written, end-of-document tokens included."""
    skipped_documents: int
    """Empty documents left out."""
    vocab_size: int
    eod_id: int
    """The end-of-document token's id."""
    dtype: str
    """The token file's integer type (uint16 or uint32)."""
    tokenizer: str
    removed_stale: tuple[str, ...] = ()
    """Temporary directories a killed prepare had left next to ``out``, removed: only ones holding trainfit's
    marker of a process that has ended (pid and start time) and nothing but what prepare writes."""
    extra: Mapping[str, Any] = field(default_factory=dict)

