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
    Setup,
    advice_items,
    load_run,
    memory_label,
    memory_parts,
    memory_setup,
    plan_setup,
    profile_label,
    profile_setup,
    time_parts,
    verify_setup,
    write_text_atomic,
)
from trainfit.report.numbers import fmt_num, fmt_rate, fmt_seconds, fmt_share
from trainfit.units import fmt_bytes

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;
color:#222;line-height:1.45}
h1{font-size:1.5rem}h2{font-size:1.15rem;border-bottom:1px solid #ddd;padding-bottom:.2rem;margin-top:2rem}
table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0}td,th{border:1px solid #ddd;padding:.2rem .5rem;
text-align:left;vertical-align:top;white-space:nowrap}td ul{white-space:normal;min-width:20rem;margin:0;padding-left:1rem}th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
figure{margin:.5rem 0}img.chart{max-width:100%;height:auto}figcaption{font-size:.8rem;color:#555}
.wide{overflow-x:auto}pre{background:#f7f7f7;padding:.5rem;font-size:.8rem;overflow:auto}.note{color:#8a5a00}
p.cfg{font-size:.85rem;color:#333;margin:.3rem 0}p.differs{color:#9b1c1c;background:#fff3f3;
border-left:3px solid #c44e52;padding:.25rem .5rem}
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
    """A number in a table cell, for people: thousands separators, no ``e`` notation (:mod:`report.numbers`)."""
    if isinstance(v, float):
        return fmt_num(v, digits=4)
    if isinstance(v, int) and not isinstance(v, bool):
        return fmt_num(v)
    return _e(v)


class _Raw(str):
    """Already-escaped HTML for a table cell."""


class _Num(str):
    """A number already written for people ("13,640", "1.5 GiB"): escaped, right-aligned like numbers."""


def _cell(c: object) -> str:
    if isinstance(c, _Num) or (isinstance(c, (int, float)) and not isinstance(c, bool)):
        return f'<td class="num">{_e(c) if isinstance(c, _Num) else _num(c)}</td>'
    return f"<td>{c if isinstance(c, _Raw) else _e(c)}</td>"


def _table(header: list[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(c) for c in r) + "</tr>" for r in rows)
    return f'<div class="wide"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _bytes(n: float) -> _Num:
    return _Num(fmt_bytes(n))


THE_RUN = "the run"
"""How a difference names the run's own configuration: "precision=fp32 (the run: fp16-mixed)"."""


def _setup_line(what: str, setup: Setup | None, run: Setup | None) -> str:
    """One line naming the configuration ``what`` was measured on; marked, with the difference spelled out,
    when it is not the run's (config.toml)."""
    if setup is None or not setup.known():
        return f'<p class="cfg">{_e(what)}: configuration not recorded.</p>'
    diff = setup.difference_text(run)
    if diff:
        return (f'<p class="cfg differs"><b>{_e(what)}: measured with {_e(diff)}</b> -- a different configuration '
                f"from the run's, so its numbers do not describe the run. All levers: {_e(setup.describe())}.</p>")
    return f'<p class="cfg">{_e(what)}: measured with {_e(setup.describe())}{_as_run(setup, run)}.</p>'


def _as_run(setup: Setup, run: Setup | None) -> str:
    """ " -- the run's configuration (config.toml)" when ``setup`` matches it (in every lever it recorded)."""
    if run is None:
        return ""
    partly = " in every lever recorded" if len(setup.known()) < len(run.known()) else ""
    return f" -- the run's configuration (config.toml){partly}"


def _vs_run(setup: Setup, run: Setup | None) -> str:
    """The table cell comparing one entry with the run: "as the run" or what differs."""
    if run is None:
        return "no config.toml to compare"
    return setup.difference_text(run) or "as the run"


def _mark(setup: Setup, run: Setup | None) -> str:
    """The red line a chart draws under a bar measured on another configuration ("" for the run's own)."""
    diff = setup.difference_text(run)
    return f"differs from the run: {diff}" if diff else ""


def _loss_section(art: RunArtifacts, notes: list[str]) -> str:
    s = art.loss
    if s is None:
        return ""
    finite = [v for v in s.loss if math.isfinite(v)]
    rows = [["optimizer steps", len(s.steps)], ["first loss", finite[0] if finite else math.nan],
            ["last loss", finite[-1] if finite else math.nan], ["skipped steps", len(s.skipped)],
            ["final loss scale", s.loss_scale[-1]]]
    if s.final_val:  # a run with --eval-every; an older log has no such key and no such row
        at, val, ppl = s.final_val
        rows += [[f"final validation loss (step {fmt_num(at)})", val], ["final validation perplexity", ppl]]
    known_lr = [v for v in s.lr if math.isfinite(v)]
    if known_lr:
        rows.append(["learning rate (first → last)" if s.lr_varies else "learning rate",
                     f"{fmt_num(known_lr[0])} → {fmt_num(known_lr[-1])}" if s.lr_varies else known_lr[0]])
    trained = (f'<p class="cfg">Trained with: {_e(art.setup.describe())} (config.toml, the configuration that wrote '
               "metrics.jsonl).</p>" if art.setup else
               '<p class="cfg">Trained with: configuration not recorded (no readable config.toml in the run '
               "directory).</p>")
    out = ["<h2>Loss</h2>", trained, _table(["", "value"], rows),
           _chart(notes, "loss curve", f"Loss per optimizer step from metrics.jsonl; {len(s.skipped)} skipped "
                  "step(s) marked with a red cross; steps whose loss is not finite are gaps"
                  + (f"; validation loss (orange points) at {len(s.val_steps)} evaluation(s)" if s.val_steps else "")
                  + ("; learning rate dashed, right axis" if s.lr_varies else "") + ".", plots.loss_png, s)]
    if s.scaled:
        out.append(_chart(notes, "loss scale", "Dynamic loss scale (halved on overflow, doubled after a run of "
                          "clean steps); red lines are skipped steps.", plots.loss_scale_png, s))
    else:
        out.append("<p>Loss scale: 1 throughout (this precision does not scale the loss).</p>")
    if s.skipped:
        shown = ", ".join(fmt_num(k) for k in s.skipped[:50]) + (" ..." if len(s.skipped) > 50 else "")
        out.append(f"<p>Skipped steps: {_e(shown)}</p>")
    return "\n".join(out)


def _memory_section(art: RunArtifacts, notes: list[str]) -> str:
    if not art.memory:
        return ""
    labels = [memory_label(r) for r in art.memory]
    setups = [memory_setup(r) for r in art.memory]
    parts = [memory_parts(r) for r in art.memory]
    peaks: list[int | None] = [r.peak_bytes for r in art.memory]
    marks = [_mark(su, art.setup) for su in setups]
    lines = [_setup_line(f"memory {i + 1} ({lab})", su, art.setup) for i, (lab, su) in enumerate(zip(labels, setups))]
    rows = [[lab, _vs_run(su, art.setup)] + [_bytes(v) for v in p.values()] + [_bytes(r.peak_bytes), r.peak_phase,
                                                                               r.method]
            for lab, p, r, su in zip(labels, parts, art.memory, setups)]
    header = ["configuration", "vs the run"] + list(parts[0]) + ["peak", "peak phase", "method"]
    return "\n".join(["<h2>Memory</h2>", *lines,
                      _chart(notes, "memory parts", "Largest live bytes of each part during one optimizer step; the "
                             "black tick is the peak (parts need not all be at their largest at the same moment); "
                             "a bar measured on another configuration than the run's says so in red"
                             f"{_first_bars(len(labels))}.", plots.memory_png,
                             [f"memory {i + 1}: {lab}\n{su.short()}" for i, (lab, su) in enumerate(zip(labels, setups))],
                             parts, peaks, marks),
                      _table(header, rows)])


def _first_bars(n: int) -> str:
    return f"; the first {plots.MAX_BARS} of {n} shown" if n > plots.MAX_BARS else ""


def _time_section(art: RunArtifacts, notes: list[str]) -> str:
    # (table label, chart label, phases, bottleneck, configuration, throughput)
    shown = []
    for i, p in enumerate(art.profile):
        su = profile_setup(p)
        how = f"median of {fmt_num(p.steps)} profiled steps after {fmt_num(p.warmup)} warm-up"
        rate = fmt_rate(p.tokens_per_s, "tokens") if p.tokens_per_s is not None else fmt_rate(p.samples_per_s,
                                                                                              "samples")
        shown.append((profile_label(p, i), f"profile {i + 1} ({how})\n{su.short()}", time_parts(p), p.bottleneck,
                      su, rate))
    if art.train_time:  # train logs its phases too: shown beside (or instead of) a profile
        su = art.setup or Setup()
        how = f"median of {fmt_num(art.train_time_steps)} logged steps, the first left out"
        shown.append(("train (metrics.jsonl)", f"train (metrics.jsonl, {how})\n{su.short()}", art.train_time, "",
                      art.setup, ""))
    if not shown:
        return ""
    ref, ref_name = art.setup, THE_RUN
    if ref is None:  # no config.toml: the bars are compared with the first that recorded its configuration
        first = next((i for i, x in enumerate(shown) if x[4] is not None and x[4].known()), None)
        if first is not None:
            ref, ref_name = shown[first][4], shown[first][0].split(":")[0]
    marks, lines = [], []
    for lab, _, _, _, su, _ in shown:
        diff = su.difference_text(ref, ref_name) if su is not None else ""
        marks.append(f"differs from {ref_name}: {diff}" if diff else "")
        if su is None or not su.known():
            lines.append(f'<p class="cfg">{_e(lab.split(":")[0])}: configuration not recorded (no readable '
                         "config.toml).</p>")
        elif diff:
            lines.append(f'<p class="cfg differs"><b>{_e(lab.split(":")[0])}: measured with {_e(diff)}</b> -- its '
                         f"times are not comparable with those of {_e(ref_name)}. All levers: {_e(su.describe())}.</p>")
        else:
            same = _as_run(su, art.setup) if art.setup is not None else f" -- as {ref_name}" if ref is not su else ""
            lines.append(f'<p class="cfg">{_e(lab.split(":")[0])}: measured with {_e(su.describe())}{same}.</p>')
    rows = []
    for lab, _, t, bottleneck, _, rate in shown:
        total = sum(t.values()) or 1.0
        rows += [[lab, k, _Num(fmt_num(v * 1e3)), fmt_share(v / total)] for k, v in t.items()]
        if bottleneck:
            rows.append([lab, "bottleneck", _Raw(f"<b>{_e(bottleneck)}</b>"), ""])
        if rate:
            rows.append([lab, "throughput (per device)", _Num(rate), ""])
    caption = ("Median time per optimizer step by phase, each bar labelled with the configuration it was measured "
               "on. Profile bars are trainfit profile's medians over its profiled steps; the train bar is the median "
               "over the steps train logged in metrics.jsonl. A bar measured on a different configuration says so in "
               f"red: its times are not comparable with the others{_first_bars(len(shown))}.")
    return "\n".join(["<h2>Step time</h2>", *lines,
                      _chart(notes, "step time breakdown", caption, plots.time_png, [s[1] for s in shown],
                             [s[2] for s in shown], marks),
                      _table(["measured by", "phase", "ms (median)", "share"], rows)])


def _list(items) -> _Raw:
    return _Raw("<ul>" + "".join(f"<li>{_e(x)}</li>" for x in items) + "</ul>")


def _plan_section(art: RunArtifacts) -> str:
    out = []
    header = ["precision", "micro_batch", "accumulation", "checkpointing", "strategy", "grad_sync",
              "peak per device", "step time", "scaling efficiency", "fits", "compute", "exposed comm", "vs the run",
              "reasons"]
    for plan in art.plan:
        out.append(f"<p>{_e(plan.model)}: global batch {_e(fmt_num(plan.global_batch))} on "
                   f"{_e(fmt_num(plan.devices))} device(s) of {_e(fmt_bytes(plan.device_memory_bytes))}; basis "
                   f"{_e(plan.basis)}; {_e(fmt_num(plan.candidates))} candidates, {len(plan.plans)} shown. Each row "
                   "is a configuration planned, not measured; the row names its levers, and 'vs the run' what differs "
                   "from the run's config.toml.</p>")
        out.append(_table(header, [[r.precision, r.micro_batch, r.accumulation, r.checkpointing, r.strategy,
                                    r.grad_sync, _bytes(r.peak_bytes_per_device), _Num(fmt_seconds(r.step_s)),
                                    _Num(fmt_share(r.scaling_efficiency)), r.fits, _Num(fmt_seconds(r.compute_s)),
                                    _Num(fmt_seconds(r.exposed_comm_s)),
                                    _vs_run(plan_setup(r, plan.devices), art.setup), _list(r.reasons)]
                                   for r in plan.plans]))
    return "<h2>Plan</h2>\n" + "\n".join(out) if out else ""


def _verify_section(art: RunArtifacts) -> str:
    if not art.verify:
        return ""
    header = ["precision", "strategy", "micro_batch", "accumulation", "world_size", "global_batch", "grad_cosine",
              "grad_rel_error", "grad_norm_ratio", "update_max_rel_error", "skipped_steps", "fp16_underflow_frac",
              "loss_scale", "passed", "tolerance", "vs the run", "causes"]
    setups = [verify_setup(r) for r in art.verify]
    lines = [_setup_line(f"verify {i + 1}", su, art.setup) for i, su in enumerate(setups)]
    # as precise as `trainfit verify` prints them: a cosine of 0.99998 must not read as 1
    rows = [[r.precision, r.strategy, r.micro_batch, r.accumulation, r.world_size, r.global_batch,
             _Num(f"{r.grad_cosine:.8f}" if math.isfinite(r.grad_cosine) else fmt_num(r.grad_cosine)),
             _Num(fmt_num(r.grad_rel_error)), _Num(fmt_num(r.grad_norm_ratio, digits=6)),
             _Num(fmt_num(r.update_max_rel_error)), r.skipped_steps, _Num(fmt_share(r.fp16_underflow_frac)),
             r.loss_scale, r.passed,
             _list([f"cosine >= {fmt_num(r.tolerance.min_cosine, digits=8)}",
                    f"gradient error <= {fmt_num(r.tolerance.max_grad_rel_error)}",
                    f"update error <= {fmt_num(r.tolerance.max_update_rel_error)}"]),
             _vs_run(su, art.setup), _list(r.causes)] for r, su in zip(art.verify, setups)]
    return "<h2>Verify</h2>\n" + "\n".join(lines) + "\n" + _table(header, rows)


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
        (f'<p class="cfg">The run\'s configuration (config.toml): {_e(art.setup.describe())}. Each section below '
         "names the configuration it was measured on, and says so when that is not this one.</p>" if art.setup else
         '<p class="cfg">No readable config.toml: each section names the configuration its own file recorded.</p>'),
        _loss_section(art, notes), _memory_section(art, notes), _time_section(art, notes), _plan_section(art),
        _verify_section(art),
    ]
    if art.empty:
        parts.append('<p class="note">Nothing in this directory could be read as a report; the notes below say '
                     "why.</p>")
    if advice:
        parts.append("<h2>Advice</h2><ol>" + "".join(f"<li><b>{_e(s)}</b>: {_e(t)}</li>" for s, t in advice) + "</ol>")
    if art.config:
        parts.append("<h2>Configuration</h2><p class=\"cfg\">config.toml as train wrote it: the run's configuration, "
                     f"which every section above is compared with.</p><pre>{_e(art.config)}</pre>")
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
