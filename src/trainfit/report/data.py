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
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainfit.results import MemoryReport, PlanReport, ProfileReport, ResultFormatError, VerifyReport

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

    @property
    def scaled(self) -> bool:
        """True when any step used a loss scale other than 1 (fp16 policies)."""
        return any(s != 1.0 for s in self.loss_scale)


@dataclass(frozen=True, kw_only=True)
class RunArtifacts:
    run_dir: str
    config: str = ""
    """config.toml as written by train (empty when absent)."""
    loss: LossSeries | None = None
    memory: list[MemoryReport] = field(default_factory=list)
    profile: list[ProfileReport] = field(default_factory=list)
    plan: list[PlanReport] = field(default_factory=list)
    verify: list[VerifyReport] = field(default_factory=list)
    train_time: dict[str, float] = field(default_factory=dict)
    """Median seconds per phase over the logged training steps (from metrics.jsonl)."""
    notes: list[str] = field(default_factory=list)
    """Files that were present but unreadable, said once each."""

    @property
    def empty(self) -> bool:
        return not (self.loss or self.memory or self.profile or self.plan or self.verify)


def loss_series(rows: list[dict]) -> LossSeries:
    """metrics.jsonl rows -> the loss curve; a resumed run's repeated steps keep the last line."""
    by_step: dict[int, dict] = {}
    for r in rows:
        by_step[int(r["step"])] = r
    steps = sorted(by_step)
    loss = [_finite_or_nan(by_step[s].get("loss")) for s in steps]
    scale = [float(by_step[s].get("loss_scale", 1.0)) for s in steps]
    skipped = [s for s in steps if by_step[s].get("stepped") is False]
    return LossSeries(steps=steps, loss=loss, loss_scale=scale, skipped=skipped)


def train_time_parts(rows: list[dict]) -> dict[str, float]:
    """Median seconds per phase of the steps train logged (the first step, with its warm-up, left out)."""
    rows = [r for r in rows if isinstance(r.get("forward_s"), (int, float))][1:] or rows[:1]
    if not rows or not isinstance(rows[0].get("forward_s"), (int, float)):
        return {}

    def med(key: str, extra: str = "") -> float:
        vals = sorted(float(r.get(key, 0.0) or 0.0) + float(r.get(extra, 0.0) or 0.0) if extra else
                      float(r.get(key, 0.0) or 0.0) for r in rows)
        n = len(vals)
        return vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2

    out = {"data_wait": med("data_wait_s"), "forward": med("forward_s"),
           "backward": med("backward_s", "backward_sync_s"), "optimizer": med("optimizer_s")}
    out["rest"] = max(0.0, med("step_s") - sum(out.values()))
    return out


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
    for p in art.profile:
        items += [("profile", a.text) for a in p.advice]
    for plan in art.plan:
        items += [("plan", n) for n in plan.notes]
    for m in art.memory:
        items.append(("memory", f"{memory_label(m)}: {m.lever_line}"))
        items += [("memory", n) for n in m.notes]
    return items


def _finite_or_nan(v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f if math.isfinite(f) else math.nan


def read_docs(path: Path, notes: list[str]) -> list[Any]:
    """The JSON values a report file holds (one object, or a list of them); [] with a note when unreadable."""
    if not path.exists():
        return []
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        notes.append(f"{path.name}: not readable as JSON ({e}); left out")
        return []
    if isinstance(d, dict) and isinstance(d.get("reports"), list):  # the container docs/report.md allows
        d = d["reports"]
    return d if isinstance(d, list) else [d]


def read_reports(path: Path, kind, notes: list[str]) -> list:
    """Each object in ``path`` as a ``kind`` (e.g. MemoryReport) via ``from_dict``; one note per object that is not."""
    docs = read_docs(path, notes)
    out = []
    for i, d in enumerate(docs):
        try:
            out.append(kind.from_dict(d))
        except ResultFormatError as e:
            where = path.name if len(docs) == 1 else f"{path.name} entry {i + 1}"
            notes.append(f"{where}: not a {kind.__name__} ({e}); left out")
    return out


def load_run(run_dir: str | Path) -> RunArtifacts:
    """Read whatever the run directory holds (see the module docstring)."""
    root = Path(run_dir)
    notes: list[str] = []
    loss, train_time = None, {}
    metrics = root / METRICS
    if metrics.exists():
        rows = []
        for i, line in enumerate(metrics.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                int(row["step"])
                rows.append(row)
            except (ValueError, KeyError, TypeError):  # a line cut short by a crash
                notes.append(f"{METRICS} line {i}: not a metrics record; skipped")
        loss = loss_series(rows) if rows else None
        train_time = train_time_parts(rows)
    cfg = root / "config.toml"
    return RunArtifacts(
        run_dir=str(root), config=cfg.read_text() if cfg.exists() else "", loss=loss,
        memory=read_reports(root / MEMORY, MemoryReport, notes),
        profile=read_reports(root / PROFILE, ProfileReport, notes),
        plan=read_reports(root / PLAN, PlanReport, notes), verify=read_reports(root / VERIFY, VerifyReport, notes),
        train_time=train_time, notes=notes,
    )
