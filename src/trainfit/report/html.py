"""One self-contained HTML page for a run directory: charts embedded as base64 PNG, no network.

``write_report(run_dir)`` reads what the directory holds (:mod:`trainfit.report.data`) and writes
``RUN_DIR/report.html``. Sections appear only for the files present.
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

from trainfit.errors import ConfigError
from trainfit.report import plots
from trainfit.report.data import (
    REPORT,
    RunArtifacts,
    advice_items,
    load_run,
    memory_label,
    memory_parts,
    profile_label,
    time_parts,
    write_text_atomic,
)
from trainfit.units import fmt_bytes

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;
color:#222;line-height:1.45}
h1{font-size:1.5rem}h2{font-size:1.15rem;border-bottom:1px solid #ddd;padding-bottom:.2rem;margin-top:2rem}
table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0}td,th{border:1px solid #ddd;padding:.2rem .5rem;
text-align:left;vertical-align:top;white-space:nowrap}td ul{white-space:normal;min-width:20rem;margin:0;padding-left:1rem}th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
figure{margin:.5rem 0}img.chart{max-width:100%;height:auto}figcaption{font-size:.8rem;color:#555}
.wide{overflow-x:auto}pre{background:#f7f7f7;padding:.5rem;font-size:.8rem;overflow:auto}.note{color:#8a5a00}
"""


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _img(png: bytes, alt: str, caption: str) -> str:
    b64 = base64.b64encode(png).decode("ascii")
    return (f'<figure><img class="chart" alt="{_e(alt)}" src="data:image/png;base64,{b64}">'
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _chart(notes: list[str], alt: str, caption: str, draw, *args) -> str:
    """A chart as an ``<img>``; when matplotlib cannot draw it (data it chokes on), a note instead: the tables
    still show the numbers, and a picture must never cost the page."""
    try:
        png = draw(*args)
    except Exception as e:  # noqa: BLE001 - matplotlib's errors have no common base; each becomes a note
        notes.append(" ".join(f"{alt} chart not drawn ({type(e).__name__}: {e}"[:240].split()) + ")")
        return ""
    return _img(png, alt, caption)


def _num(v: object) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        return f"{v:.0f}" if v.is_integer() and abs(v) < 1e12 else f"{v:.4g}"
    return _e(v)


def _table(header: list[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{_num(c)}</td>' if isinstance(c, (int, float)) and not isinstance(c, bool)
                         else f"<td>{c if isinstance(c, _Raw) else _e(c)}</td>" for c in r) + "</tr>"
        for r in rows)
    return f'<div class="wide"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


class _Raw(str):
    """Already-escaped HTML for a table cell."""


def _loss_section(art: RunArtifacts, notes: list[str]) -> str:
    s = art.loss
    if s is None:
        return ""
    finite = [v for v in s.loss if math.isfinite(v)]
    rows = [["optimizer steps", len(s.steps)], ["first loss", finite[0] if finite else math.nan],
            ["last loss", finite[-1] if finite else math.nan], ["skipped steps", len(s.skipped)],
            ["final loss scale", s.loss_scale[-1]]]
    out = ["<h2>Loss</h2>", _table(["", "value"], rows),
           _chart(notes, "loss curve", f"Loss per optimizer step from metrics.jsonl; {len(s.skipped)} skipped "
                  "step(s) marked with a red cross; steps whose loss is not finite are gaps.", plots.loss_png, s)]
    if s.scaled:
        out.append(_chart(notes, "loss scale", "Dynamic loss scale (halved on overflow, doubled after a run of "
                          "clean steps); red lines are skipped steps.", plots.loss_scale_png, s))
    else:
        out.append("<p>Loss scale: 1 throughout (this precision does not scale the loss).</p>")
    if s.skipped:
        shown = ", ".join(str(k) for k in s.skipped[:50]) + (" ..." if len(s.skipped) > 50 else "")
        out.append(f"<p>Skipped steps: {_e(shown)}</p>")
    return "\n".join(out)


def _memory_section(art: RunArtifacts, notes: list[str]) -> str:
    if not art.memory:
        return ""
    labels = [memory_label(r) for r in art.memory]
    parts = [memory_parts(r) for r in art.memory]
    peaks: list[int | None] = [r.peak_bytes for r in art.memory]
    mib = 2.0**20
    rows = [[lab] + [v / mib for v in p.values()] + [r.peak_bytes / mib, r.peak_phase, r.method]
            for lab, p, r in zip(labels, parts, art.memory)]
    header = ["configuration"] + [f"{k} MiB" for k in parts[0]] + ["peak MiB", "peak phase", "method"]
    return "\n".join(["<h2>Memory</h2>", _chart(notes, "memory parts", "Largest live bytes of each part during one "
                      "optimizer step; the black tick is the peak (parts need not all be at their largest at the same "
                      f"moment){_first_bars(len(labels))}.", plots.memory_png, labels, parts, peaks),
                      _table(header, rows)])


def _first_bars(n: int) -> str:
    return f"; the first {plots.MAX_BARS} of {n} shown" if n > plots.MAX_BARS else ""


def _time_section(art: RunArtifacts, notes: list[str]) -> str:
    shown = [(profile_label(p, i), time_parts(p), p.bottleneck) for i, p in enumerate(art.profile)]
    if art.train_time:  # train logs its phases too: shown beside (or instead of) a profile
        shown.append(("train (metrics.jsonl)", art.train_time, ""))
    if not shown:
        return ""
    rows = []
    for lab, t, bottleneck in shown:
        total = sum(t.values()) or 1.0
        rows += [[lab, k, v * 1e3, f"{v / total:.0%}"] for k, v in t.items()]
        if bottleneck:
            rows.append([lab, "bottleneck", _Raw(f"<b>{_e(bottleneck)}</b>"), ""])
    return "\n".join(["<h2>Step time</h2>",
                      _chart(notes, "step time breakdown", f"Median time per optimizer step by phase"
                             f"{_first_bars(len(shown))}.", plots.time_png, [s[0] for s in shown],
                             [s[1] for s in shown]),
                      _table(["profile", "phase", "ms (median)", "share"], rows)])


def _list(items) -> _Raw:
    return _Raw("<ul>" + "".join(f"<li>{_e(x)}</li>" for x in items) + "</ul>")


def _plan_section(art: RunArtifacts) -> str:
    out = []
    header = ["precision", "micro_batch", "accumulation", "checkpointing", "strategy", "grad_sync",
              "peak MiB per device", "step_s", "scaling_efficiency", "fits", "compute_s", "exposed_comm_s", "reasons"]
    for plan in art.plan:
        out.append(f"<p>{_e(plan.model)}: global batch {plan.global_batch} on {plan.devices} device(s) of "
                   f"{_e(fmt_bytes(plan.device_memory_bytes))}; basis {_e(plan.basis)}; {plan.candidates} "
                   f"candidates, {len(plan.plans)} shown</p>")
        out.append(_table(header, [[r.precision, r.micro_batch, r.accumulation, r.checkpointing, r.strategy,
                                    r.grad_sync, r.peak_bytes_per_device / 2**20, r.step_s, r.scaling_efficiency,
                                    r.fits, r.compute_s, r.exposed_comm_s, _list(r.reasons)] for r in plan.plans]))
    return "<h2>Plan</h2>\n" + "\n".join(out) if out else ""


def _verify_section(art: RunArtifacts) -> str:
    if not art.verify:
        return ""
    header = ["precision", "strategy", "micro_batch", "accumulation", "world_size", "global_batch", "grad_cosine",
              "grad_rel_error", "grad_norm_ratio", "update_max_rel_error", "skipped_steps", "fp16_underflow_frac",
              "loss_scale", "passed", "tolerance", "causes"]
    # as precise as `trainfit verify` prints them: a cosine of 0.99998 must not read as 1
    rows = [[r.precision, r.strategy, r.micro_batch, r.accumulation, r.world_size, r.global_batch,
             f"{r.grad_cosine:.8f}", f"{r.grad_rel_error:.3e}", f"{r.grad_norm_ratio:.6g}",
             f"{r.update_max_rel_error:.3e}", r.skipped_steps, f"{r.fp16_underflow_frac:.2%}", r.loss_scale, r.passed, _list([f"cosine >= {r.tolerance.min_cosine}",
                                            f"gradient error <= {r.tolerance.max_grad_rel_error}",
                                            f"update error <= {r.tolerance.max_update_rel_error}"]),
             _list(r.causes)] for r in art.verify]
    return "<h2>Verify</h2>\n" + _table(header, rows)


PAGE_START = "<!doctype html><html lang=en><head><meta charset=utf-8>\n<title>trainfit report: "
"""How every page trainfit writes begins (how ``report`` knows a RUN_DIR/report.html is its own)."""


def render(art: RunArtifacts) -> str:
    """The whole page as one string (charts that could not be drawn are added to the notes shown)."""
    return render_with_notes(art)[0]


def render_with_notes(art: RunArtifacts) -> tuple[str, list[str]]:
    """The page, and every note on it (the files and lines left out, the charts not drawn)."""
    notes = list(art.notes)
    advice = advice_items(art)
    parts = [
        PAGE_START.split("\n")[0],
        f"<title>trainfit report: {_e(art.run_dir)}</title><style>{CSS}</style></head><body>",
        f"<h1>trainfit report</h1><p>Run directory: <code>{_e(art.run_dir)}</code></p>",
        _loss_section(art, notes), _memory_section(art, notes), _time_section(art, notes), _plan_section(art),
        _verify_section(art),
    ]
    if art.empty:
        parts.append('<p class="note">Nothing in this directory could be read as a report; the notes below say '
                     "why.</p>")
    if advice:
        parts.append("<h2>Advice</h2><ol>" + "".join(f"<li><b>{_e(s)}</b>: {_e(t)}</li>" for s, t in advice) + "</ol>")
    if art.config:
        parts.append(f"<h2>Configuration</h2><pre>{_e(art.config)}</pre>")
    if notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f'<li class="note">{_e(n)}</li>' for n in notes) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p), notes


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Render ``run_dir`` into ``out`` (default ``RUN_DIR/report.html``); returns the path written."""
    return write_page(run_dir, out)[0]


def write_page(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, list[str]]:
    """Render ``run_dir`` into ``out`` (default ``RUN_DIR/report.html``), atomically (nothing half-written,
    no temporary file left behind); returns the path written and the page's notes.

    Raises:
        ConfigError: ``run_dir`` is not a directory, or holds none of the files a report shows.
    """
    root = Path(run_dir)
    if not root.is_dir():
        what = "a directory (this path is a file)" if root.exists() else "an existing run directory"
        raise ConfigError("run_dir", str(root), what, "run `trainfit train --run-dir DIR` first")
    art = load_run(root)
    if art.empty and not art.present:
        raise ConfigError("run_dir", str(root), "a directory with metrics.jsonl, memory.json, profile.json, "
                          "plan.json or verify.json", "run `trainfit train` (or memory/profile/plan with --report)")
    path = Path(out) if out else root / REPORT
    page, notes = render_with_notes(art)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, page)
    return path, notes
