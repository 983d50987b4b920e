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

The JSON files are the commands' own ``--json`` objects, stored as printed, so the report
follows their keys; it accepts a single object or a list of them (e.g. one memory report per
configuration), and skips a file it cannot read with a note instead of failing the whole page.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"
MEMORY = "memory.json"
PROFILE = "profile.json"
PLAN = "plan.json"
VERIFY = "verify.json"
REPORT = "report.html"

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "temporaries")
TIME_PARTS = ("data_wait", "h2d", "forward", "backward", "comm_exposed", "optimizer", "rest")


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
    memory: list[dict] = field(default_factory=list)
    profile: list[dict] = field(default_factory=list)
    plan: list[dict] = field(default_factory=list)
    verify: list[dict] = field(default_factory=list)
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


def memory_parts(report: dict) -> dict[str, int]:
    """The parts' bytes of one memory report (``params_bytes``... or a ``parts`` mapping)."""
    parts = report.get("parts")
    if isinstance(parts, dict):
        return {p: int(parts.get(p, parts.get(f"{p}_bytes", 0)) or 0) for p in MEMORY_PARTS}
    return {p: int(report.get(f"{p}_bytes", 0) or 0) for p in MEMORY_PARTS}


def memory_label(report: dict, index: int) -> str:
    keys = ("label", "precision", "checkpointing", "strategy", "batch")
    bits = [f"{report[k]}" if k != "batch" else f"batch {report[k]}" for k in keys if report.get(k) not in (None, "")]
    return " / ".join(bits) or f"report {index + 1}"


def time_parts(profile: dict) -> dict[str, float]:
    """Median seconds per phase of one profile (keys ``forward_s`` or ``forward``, float or spread dict)."""
    src = next((profile[k] for k in ("parts", "breakdown", "phases", "step_time") if isinstance(profile.get(k), dict)), profile)
    out = {}
    for p in TIME_PARTS:
        v = src.get(f"{p}_s", src.get(p))
        if isinstance(v, dict):
            v = v.get("median")
        if isinstance(v, (int, float)) and math.isfinite(v):
            out[p] = float(v)
    return out


def advice_items(art: RunArtifacts) -> list[tuple[str, str]]:
    """(source, text) for every piece of advice the run's files carry, in their own order."""
    items: list[tuple[str, str]] = []
    for src, docs in (("profile", art.profile), ("plan", art.plan), ("memory", art.memory)):
        for d in docs:
            for a in d.get("advice", []) or []:
                items.append((src, a.get("text", str(a)) if isinstance(a, dict) else str(a)))
            if src == "plan":
                items.extend((src, str(n)) for n in d.get("notes", []) or [])
            if src == "memory":
                if d.get("lever") and d.get("dominant_part"):
                    items.append((src, f"{d['dominant_part']} dominate the peak; lever: {d['lever']}"))
                items.extend((src, str(n)) for n in d.get("notes", []) or [])
    return items


def plan_rows(plan: dict) -> list[dict]:
    """The ranked candidates of one planner output (``plans``/``candidates``/``ranked``), else the plan itself."""
    for k in ("plans", "candidates", "ranked", "rows"):
        if isinstance(plan.get(k), list):
            return [r for r in plan[k] if isinstance(r, dict)]
    return [plan]


def _finite_or_nan(v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f if math.isfinite(f) else math.nan


def read_docs(path: Path, notes: list[str]) -> list[dict]:
    if not path.exists():
        return []
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        notes.append(f"{path.name}: not readable as JSON ({e}); left out")
        return []
    if isinstance(d, dict) and isinstance(d.get("reports"), list):
        d = d["reports"]
    docs = d if isinstance(d, list) else [d]
    return [x for x in docs if isinstance(x, dict)]


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
        memory=read_docs(root / MEMORY, notes), profile=read_docs(root / PROFILE, notes),
        plan=read_docs(root / PLAN, notes), verify=read_docs(root / VERIFY, notes), train_time=train_time, notes=notes,
    )
