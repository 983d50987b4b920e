"""What a run directory holds, read into plain series and rows (pure: no torch, no matplotlib).

The report reads whichever of these files the run directory has; each is written by a command:

==================  =====================================  ==========================================
file                written by                             shown as
==================  =====================================  ==========================================
``metrics.jsonl``   ``trainfit train`` (one line a step)   loss curve with skipped steps, loss scale
``memory.json``     ``trainfit memory --report``           stacked bars of the four parts (+ temporaries)
``profile.json``    ``trainfit profile --report``          step-time breakdown, advice
``plan.json``       ``trainfit plan --report``             plan table with reasons, advice
``verify.json``     ``trainfit verify --report``           agreement table
==================  =====================================  ==========================================

The JSON files are the commands' own ``--json`` objects, stored as printed: a single object or a
list of them (e.g. one memory report per configuration). Each object is read back into its typed
report (:mod:`trainfit.results`: ``MemoryReport``, ``ProfileReport``, ``PlanReport``, ``VerifyReport``)
with ``from_dict``, and the page reads their attributes; a file (or an entry of one) that is not
readable as its report is named in a note and left out instead of failing the whole page.

What "not readable" covers, each said in a note on the page (at most :data:`MAX_NOTES_PER_FILE` per file,
then a count): a file that is not a regular file, not UTF-8, empty, not JSON (cut short, nested deeper than
Python reads) or not the report its name says (wrong types anywhere, a bare number); a metrics.jsonl line
that is not UTF-8, not JSON, not an object, has no whole-number ``step`` >= 0, or a value of the wrong type
(``"loss_scale": "abc"``, a list) -- skipped with its line number, the other lines kept. Non-finite numbers
are not errors (a diverged step is worth showing): NaN/Infinity tokens are read as such, the nulls that
``outputs.dumps_json`` writes for them are put back from the object's ``"non_finite"`` list, and charts
leave out what is not finite. An unreadable config.toml is a note too.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainfit.errors import ConfigError
from trainfit.gate import RECORD, parse_document
from trainfit.results import MemoryReport, PlanReport, PlanRow, ProfileReport, ResultFormatError, VerifyReport

METRICS = "metrics.jsonl"
MEMORY = "memory.json"
PROFILE = "profile.json"
PLAN = "plan.json"
VERIFY = "verify.json"
REPORT = "report.html"


@dataclass(frozen=True, kw_only=True)
class LossSeries:
    steps: list[int]
    loss: list[float]
    """NaN where the loss was not finite."""
    loss_scale: list[float]
    skipped: list[int]
    """Steps (1-based, as in metrics.jsonl) where the optimizer step was skipped."""
    val_steps: list[int] = field(default_factory=list)
    """Steps where the validation loss was computed (``eval_every``); empty for a run without evaluation or a
    log written before trainfit logged it."""
    val_loss: list[float] = field(default_factory=list)
    """Token-weighted validation loss at each of ``val_steps`` (NaN where not finite)."""
    val_perplexity: list[float] = field(default_factory=list)
    """exp(val_loss) at each of ``val_steps`` (NaN where absent or not finite)."""
    lr: list[float] = field(default_factory=list)
    """Learning rate of each step (NaN where the log has none: an older metrics.jsonl)."""

    @property
    def scaled(self) -> bool:
        """True when any step used a loss scale other than 1 (fp16 policies)."""
        return any(math.isfinite(s) and s != 1.0 for s in self.loss_scale)

    @property
    def lr_varies(self) -> bool:
        """True when the logged learning rate changes over the run (a warm-up or a decaying schedule)."""
        known = {v for v in self.lr if math.isfinite(v)}
        return len(known) > 1

    @property
    def final_val(self) -> tuple[int, float, float] | None:
        """(step, val loss, perplexity) of the last evaluation with a finite loss; None without one."""
        for k, v, ppl in reversed(list(zip(self.val_steps, self.val_loss, self.val_perplexity))):
            if math.isfinite(v):
                return k, v, ppl if math.isfinite(ppl) else _exp_or_nan(v)
        return None


def _exp_or_nan(v: float) -> float:
    try:
        return math.exp(v)
    except OverflowError:
        return math.nan


SETUP_KEYS = ("precision", "micro_batch", "accumulation", "checkpointing", "strategy", "world_size")
"""The levers every section names: what it was measured on (the keys of config.toml and the flags, but
``world_size`` for config.toml's ``devices``)."""


@dataclass(frozen=True, kw_only=True)
class Setup:
    """The configuration one section (or one entry of it) was measured on; None where its file did not record
    a lever (a report stored before the key existed)."""

    precision: str | None = None
    micro_batch: int | str | None = None
    accumulation: int | None = None
    checkpointing: str | None = None
    strategy: str | None = None
    world_size: int | None = None

    def known(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in SETUP_KEYS if getattr(self, k) is not None}

    def describe(self) -> str:
        """Every lever as ``key=value`` ("precision=fp16-mixed, micro_batch=2, ..."); "not recorded" for the others."""
        known = self.known()
        text = ", ".join(f"{k}={_fmt_value(v)}" for k, v in known.items())
        missing = [k for k in SETUP_KEYS if k not in known]
        if missing:
            text += ("; " if text else "") + ", ".join(missing) + " not recorded"
        return text

    def short(self) -> str:
        """One chart line: "fp16-mixed, micro-batch 2 x accumulation 2, checkpointing none, single x 1"."""
        k = self.known()
        out = [str(k["precision"])] if "precision" in k else []
        mb = [f"{w} {_fmt_value(k[key])}" for key, w in (("micro_batch", "micro-batch"), ("accumulation", "accumulation"))
              if key in k]
        if mb:
            out.append(" x ".join(mb))
        if "checkpointing" in k:
            out.append(f"checkpointing {k['checkpointing']}")
        if "strategy" in k or "world_size" in k:
            out.append(" x ".join(str(k[key]) for key in ("strategy", "world_size") if key in k))
        return ", ".join(out) or "configuration not recorded"

    def differences(self, run: Setup | None) -> list[tuple[str, object, object]]:
        """(lever, this value, the run's value) for each lever both recorded and that differs."""
        if run is None:
            return []
        mine, theirs = self.known(), run.known()
        return [(k, mine[k], theirs[k]) for k in SETUP_KEYS
                if k in mine and k in theirs and str(mine[k]) != str(theirs[k])]

    def difference_text(self, run: Setup | None, name: str = "the run") -> str:
        """ "precision=fp32 (the run: fp16-mixed)", one clause per differing lever; "" when none differ."""
        return "; ".join(f"{k}={_fmt_value(a)} ({name}: {_fmt_value(b)})" for k, a, b in self.differences(run))


def _fmt_value(v: object) -> str:
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def _known_str(v: object) -> str | None:
    return v if isinstance(v, str) and v else None


def _known_int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def config_setup(values: dict) -> Setup:
    """The levers of a config.toml (as train writes it: ``devices`` is the world size)."""
    mb = values.get("micro_batch")
    return Setup(precision=_known_str(values.get("precision")),
                 micro_batch=_known_int(mb) or _known_str(mb), accumulation=_known_int(values.get("accumulation")),
                 checkpointing=_known_str(values.get("checkpointing")), strategy=_known_str(values.get("strategy")),
                 world_size=_known_int(values.get("devices")))


def memory_setup(r: MemoryReport) -> Setup:
    return Setup(precision=_known_str(r.precision), micro_batch=_known_int(r.batch),
                 accumulation=_known_int(r.accumulation), checkpointing=_known_str(r.checkpointing),
                 strategy=_known_str(r.strategy), world_size=_known_int(r.world_size))


def profile_setup(p: ProfileReport) -> Setup:
    return Setup(precision=_known_str(p.precision), micro_batch=_known_int(p.micro_batch),
                 accumulation=_known_int(p.accumulation), checkpointing=_known_str(p.checkpointing),
                 strategy=_known_str(p.strategy), world_size=_known_int(p.world_size))


def verify_setup(v: VerifyReport) -> Setup:
    return Setup(precision=_known_str(v.precision), micro_batch=_known_int(v.micro_batch),
                 accumulation=_known_int(v.accumulation), checkpointing=_known_str(v.checkpointing),
                 strategy=_known_str(v.strategy), world_size=_known_int(v.world_size))


def plan_setup(row: PlanRow, devices: int) -> Setup:
    return Setup(precision=_known_str(row.precision), micro_batch=_known_int(row.micro_batch),
                 accumulation=_known_int(row.accumulation), checkpointing=_known_str(row.checkpointing),
                 strategy=_known_str(row.strategy), world_size=_known_int(devices))


@dataclass(frozen=True, kw_only=True)
class RunArtifacts:
    run_dir: str
    config: str = ""
    """config.toml as written by train (empty when absent)."""
    setup: Setup | None = None
    """The run's configuration read from config.toml (the one metrics.jsonl was written by); None without one."""
    loss: LossSeries | None = None
    memory: list[MemoryReport] = field(default_factory=list)
    profile: list[ProfileReport] = field(default_factory=list)
    plan: list[PlanReport] = field(default_factory=list)
    verify: list[VerifyReport] = field(default_factory=list)
    train_time: dict[str, float] = field(default_factory=dict)
    """Median seconds per phase over the logged training steps (from metrics.jsonl)."""
    train_time_steps: int = 0
    """How many logged steps those medians are over."""
    notes: list[str] = field(default_factory=list)
    """Files that were present but unreadable, said once each."""
    present: list[str] = field(default_factory=list)
    """The report files the directory holds, readable or not."""

    @property
    def empty(self) -> bool:
        return not (self.loss or self.memory or self.profile or self.plan or self.verify)


def loss_series(rows: list[dict]) -> LossSeries:
    """metrics.jsonl rows -> the loss curve; a resumed run's repeated steps keep the last line.

    Rows are those :func:`metrics_row` accepted (or written by train): a value that is not a finite number
    becomes NaN (drawn as a gap, never as a point).
    """
    by_step: dict[int, dict] = {}
    for r in rows:
        by_step[int(r["step"])] = r
    steps = sorted(by_step)
    loss = [_finite_or_nan(by_step[s].get("loss")) for s in steps]
    scale = [_finite_or_nan(by_step[s].get("loss_scale", 1.0)) for s in steps]
    skipped = [s for s in steps if by_step[s].get("stepped") is False]
    val_steps = [s for s in steps if by_step[s].get("val_loss") is not None]  # absent in older logs
    return LossSeries(steps=steps, loss=loss, loss_scale=scale, skipped=skipped, val_steps=val_steps,
                      val_loss=[_finite_or_nan(by_step[s]["val_loss"]) for s in val_steps],
                      val_perplexity=[_finite_or_nan(by_step[s].get("val_perplexity")) for s in val_steps],
                      lr=[_finite_or_nan(by_step[s].get("lr")) for s in steps])


def train_time_parts(rows: list[dict]) -> dict[str, float]:
    """Median seconds per phase of the steps train logged (the first step, with its warm-up, left out).

    A phase value that is missing or not a finite number counts as 0 s.
    """
    rows = _timed_rows(rows)
    if not rows:
        return {}

    def sec(r: dict, key: str) -> float:
        v = _finite_or_nan(r.get(key))
        return v if math.isfinite(v) else 0.0

    def med(key: str, extra: str = "") -> float:
        vals = sorted(sec(r, key) + (sec(r, extra) if extra else 0.0) for r in rows)
        n = len(vals)
        return vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2

    out = {"data_wait": med("data_wait_s"), "forward": med("forward_s"),
           "backward": med("backward_s", "backward_sync_s"), "optimizer": med("optimizer_s")}
    out["rest"] = max(0.0, med("step_s") - sum(out.values()))
    return {k: v for k, v in out.items() if math.isfinite(v)}


def _timed_rows(rows: list[dict]) -> list[dict]:
    """The rows whose phases train_time_parts takes the medians of (the first timed one left out, unless alone)."""
    timed = [r for r in rows if _is_number(r.get("forward_s"))]
    return timed[1:] or timed[:1]


def train_time_steps(rows: list[dict]) -> int:
    """How many logged steps :func:`train_time_parts` takes its medians over."""
    return len(_timed_rows(rows))


def memory_parts(report: MemoryReport) -> dict[str, int]:
    """The parts' largest live bytes of one memory report, in display order."""
    return report.parts


def memory_label(report: MemoryReport) -> str:
    """The configuration of one memory report (the chart's bar label: reports of one run differ in it)."""
    return f"{report.precision} / {report.checkpointing} / batch {report.batch} ({report.method})"


def time_parts(profile: ProfileReport) -> dict[str, float]:
    """Median seconds per phase of one profile (``data_wait`` ... ``rest``); a phase that is not finite is left out."""
    return {p: v for p, v in profile.phases.items() if math.isfinite(v)}


def profile_label(profile: ProfileReport, index: int) -> str:
    """The configuration one profile measured (precision and accumulation where the profile recorded them)."""
    levers = [profile.precision, f"micro-batch {profile.micro_batch}"]
    if profile.accumulation:
        levers.append(f"accumulation {profile.accumulation}")
    if profile.checkpointing:
        levers.append(f"checkpointing {profile.checkpointing}")
    return f"profile {index + 1}: " + ", ".join(x for x in levers if x) + f", {profile.strategy} x {profile.world_size}"


def advice_items(art: RunArtifacts) -> list[tuple[str, str]]:
    """(source, text) for every piece of advice the run's reports carry, in their own order."""
    items: list[tuple[str, str]] = []
    for i, p in enumerate(art.profile):
        items += [(f"profile {i + 1} ({profile_setup(p).short()})", a.text) for a in p.advice]
    for plan in art.plan:
        items += [("plan", n) for n in plan.notes]
    for m in art.memory:
        items.append(("memory", f"{memory_label(m)}: {m.lever_line}"))
        items += [("memory", n) for n in m.notes]
    return items


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite_or_nan(v: Any) -> float:
    """``v`` as a float, NaN when it is not a finite number (a string, a list, infinity, an int beyond float)."""
    if not _is_number(v):
        return math.nan
    try:
        f = float(v)
    except OverflowError:
        return math.nan
    return f if math.isfinite(f) else math.nan


MAX_NOTES_PER_FILE = 20
"""Notes said for one file before the rest are counted in one more note (a page, not a log)."""

METRIC_NUMBERS = ("loss", "loss_scale", "step_s", "forward_s", "backward_s", "backward_sync_s", "optimizer_s",
                  "data_wait_s", "h2d_s", "lr", "val_loss", "val_perplexity")
"""The numeric keys of a metrics.jsonl record the report reads (null, NaN and infinity allowed: a diverged step)."""

_MAX_STEP = 2**53


class _Notes:
    """Notes for one file, at most :data:`MAX_NOTES_PER_FILE` of them and then a count of the rest."""

    def __init__(self, notes: list[str], name: str) -> None:
        self.notes, self.name, self.more = notes, name, 0
        self.said = 0

    def add(self, text: str) -> None:
        if self.said < MAX_NOTES_PER_FILE:
            self.notes.append(_one_line(text))
            self.said += 1
        else:
            self.more += 1

    def close(self) -> None:
        if self.more:
            self.notes.append(f"{self.name}: {self.more} more like these; left out")


def _one_line(text: str, limit: int = 0) -> str:
    """``text`` on one line (runs of whitespace, newlines included, become one space), cut to ``limit`` if given."""
    text = " ".join(str(text).split())
    return text if not limit or len(text) <= limit else text[:limit - 3] + "..."


def _short(v: Any, limit: int = 40) -> str:
    try:
        r = repr(v)
    except (RecursionError, ValueError):
        r = f"<{type(v).__name__}>"
    return r if len(r) <= limit else r[:limit - 3] + "..."


def metrics_row(obj: Any) -> tuple[dict | None, str]:
    """One parsed metrics.jsonl line -> (the record, "") or (None, why it is not one)."""
    if not isinstance(obj, dict):
        return None, f"a JSON {type(obj).__name__}, not an object"
    step = obj.get("step")
    if "step" not in obj:
        return None, "no step"
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _MAX_STEP:
        return None, f"step={_short(step)} is not a whole number >= 0"
    for key in METRIC_NUMBERS:
        v = obj.get(key)
        if v is not None and not _is_number(v):
            return None, f"{key}={_short(v)} is not a number"
    if obj.get("stepped") is not None and not isinstance(obj.get("stepped"), bool):
        return None, f"stepped={_short(obj.get('stepped'))} is not true or false"
    return obj, ""


def _read_bytes(path: Path, notes: list[str]) -> bytes | None:
    """The bytes of a file the run directory holds; None with a note when it cannot be read."""
    if not path.is_file():
        notes.append(f"{path.name}: not a regular file; left out")
        return None
    try:
        return path.read_bytes()
    except OSError as e:
        notes.append(f"{path.name}: not readable ({_one_line(str(e.strerror or e), 120)}); left out")
        return None


def _read_text(path: Path, notes: list[str]) -> str | None:
    data = _read_bytes(path, notes)
    if data is None:
        return None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        notes.append(f"{path.name}: not UTF-8 text (byte {e.start}); left out")
        return None


def read_docs(path: Path, notes: list[str]) -> list[Any]:
    """The JSON values a report file holds (one object, or a list of them); [] with a note when unreadable."""
    if not path.exists() and not path.is_symlink():
        return []
    text = _read_text(path, notes)
    if text is None:
        return []
    if not text.strip():
        notes.append(f"{path.name}: empty; left out")
        return []
    try:
        d = parse_document(text, field=path.name, fmt="json", limits=RECORD)  # bounded: nesting, items, integers
    except ConfigError as e:
        notes.append(f"{path.name}: not readable as JSON ({_one_line(str(e), 160)}); left out")
        return []
    if isinstance(d, dict) and isinstance(d.get("reports"), list):  # the container docs/report.md allows
        d = d["reports"]
    return d if isinstance(d, list) else [d]


_PATH_PART = re.compile(r"\[(\d+)\]|([^.\[\]]+)")


def restore_non_finite(d: Any) -> Any:
    """A stored object with the numbers ``outputs.dumps_json`` wrote as null (listed under ``"non_finite"``,
    e.g. ``"grad_cosine=nan"``) put back as NaN/infinity, so a diverged run's report still reads as its class."""
    if not isinstance(d, dict) or not isinstance(d.get("non_finite"), list):
        return d
    listed = d["non_finite"]
    d = {k: v for k, v in d.items() if k != "non_finite"}
    for item in listed[:1000]:
        if not isinstance(item, str) or "=" not in item:
            continue
        where, _, value = item.rpartition("=")
        if value not in ("nan", "inf", "-inf"):
            continue
        parts = [int(m[1]) if m[1] else m[2] for m in _PATH_PART.finditer(where)]
        if 0 < len(parts) <= 32:
            d = _put(d, parts, float(value))
    return d


def _put(c: Any, parts: list, value: float) -> Any:
    """``c`` with the null at ``parts`` replaced by ``value`` (copies along the path; anything else unchanged)."""
    if not parts:
        return value if c is None else c
    head, rest = parts[0], parts[1:]
    if isinstance(head, int) and isinstance(c, list) and head < len(c):
        c = list(c)
        c[head] = _put(c[head], rest, value)
    elif isinstance(head, str) and isinstance(c, dict) and head in c:
        c = dict(c)
        c[head] = _put(c[head], rest, value)
    return c


def read_reports(path: Path, kind, notes: list[str]) -> list:
    """Each object in ``path`` as a ``kind`` (e.g. MemoryReport) via ``from_dict``; one note per object that is not."""
    docs = read_docs(path, notes)
    said = _Notes(notes, path.name)
    out = []
    for i, d in enumerate(docs):
        try:
            out.append(kind.from_dict(restore_non_finite(d)))
        except (ResultFormatError, RecursionError) as e:
            where = path.name if len(docs) == 1 else f"{path.name} entry {i + 1}"
            said.add(f"{where}: not a {kind.__name__} ({_one_line(str(e) or 'nested too deeply', 200)}); left out")
    said.close()
    return out


def read_metrics(path: Path, notes: list[str]) -> list[dict]:
    """The records of metrics.jsonl; a line that is not one (cut short by a crash, not UTF-8, a value of the
    wrong type) is skipped with a note naming its line number."""
    data = _read_bytes(path, notes)
    if data is None:
        return []
    said = _Notes(notes, METRICS)
    before = len(notes)
    rows = []
    for i, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
        except UnicodeDecodeError:
            said.add(f"{METRICS} line {i}: not UTF-8 text; skipped")
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # a line cut short by a crash
            said.add(f"{METRICS} line {i}: not a metrics record (not JSON); skipped")
            continue
        row, why = metrics_row(obj)
        if row is None:
            said.add(f"{METRICS} line {i}: not a metrics record ({why}); skipped")
        else:
            rows.append(row)
    said.close()
    if not rows and len(notes) == before:
        notes.append(f"{METRICS}: empty; no loss curve")
    elif not rows:
        notes.append(f"{METRICS}: no readable record; no loss curve")
    return rows


def read_config(path: Path, notes: list[str]) -> str:
    """config.toml as text to show ("" when absent; a note when it is not readable UTF-8 text)."""
    if not path.exists() and not path.is_symlink():
        return ""
    text = _read_text(path, notes)
    return text or ""


def _flat(values: dict[str, Any]) -> dict[str, Any]:
    """config.toml's keys: its section tables' keys ([levers] precision ...), or the flat keys of older runs."""
    flat = {k: v for k, v in values.items() if not isinstance(v, dict)}
    for table in values.values():
        if isinstance(table, dict):
            flat.update(table)
    return flat


def parse_config(text: str, notes: list[str]) -> Setup | None:
    """The run's levers from config.toml's text; None (with a note when there was text) when not readable."""
    if not text.strip():
        return None
    try:
        values = _flat(parse_document(text, field="config.toml", fmt="toml", limits=RECORD))
    except ConfigError as e:
        notes.append(f"config.toml: not readable as TOML ({_one_line(str(e), 120)}); the sections are not compared "
                     "with the run's configuration")
        return None
    return config_setup(values)


def load_run(run_dir: str | Path) -> RunArtifacts:
    """Read whatever the run directory holds (see the module docstring)."""
    root = Path(run_dir)
    notes: list[str] = []
    loss, train_time, timed = None, {}, 0
    metrics = root / METRICS
    if metrics.exists() or metrics.is_symlink():
        rows = read_metrics(metrics, notes)
        loss = loss_series(rows) if rows else None
        train_time, timed = train_time_parts(rows), train_time_steps(rows)
    config = read_config(root / "config.toml", notes)
    return RunArtifacts(
        run_dir=str(root), config=config, setup=parse_config(config, notes), loss=loss,
        memory=read_reports(root / MEMORY, MemoryReport, notes),
        profile=read_reports(root / PROFILE, ProfileReport, notes),
        plan=read_reports(root / PLAN, PlanReport, notes), verify=read_reports(root / VERIFY, VerifyReport, notes),
        train_time=train_time, train_time_steps=timed, notes=notes,
        present=[n for n in (METRICS, MEMORY, PROFILE, PLAN, VERIFY) if (root / n).exists() or (root / n).is_symlink()],
    )


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same directory and ``os.replace``:
    the old file stays whole until the new one is complete, and no temporary file is left on any failure."""
    path = Path(path)
    data = text.encode("utf-8", "backslashreplace")  # a lone surrogate from a JSON escape must not fail the write
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
