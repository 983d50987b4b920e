"""Issue 17, the report part: malformed run-directory files are skipped with a note, never a traceback; the
page's output path is checked before any work and written atomically; stored reports are strict JSON.

Every CLI test runs ``trainfit report`` in this process: an exception escaping ``main`` is the traceback the
issue is about, so it fails the test. Exit 0 means the page was written; exit 2 means one error line.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import shutil
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainfit.cli import main
from trainfit.commands.report import save_and_report
from trainfit.outputs import MARKER
from trainfit.report import plots
from trainfit.report.data import LossSeries, load_run
from trainfit.report.html import PAGE_START
from trainfit.results import MemoryReport, PlanReport, ProfileReport, ResultFormatError, VerifyReport

from .conftest import MEMORY, PLAN, PROFILE, VERIFY, fp16_rows

pytest.importorskip("matplotlib")

DOCS = {"memory.json": MEMORY, "profile.json": PROFILE, "plan.json": PLAN, "verify.json": VERIFY}
GOOD_METRICS = '{"step": 1, "loss": 2.0, "loss_scale": 1.0}\n{"step": 2, "loss": 1.5, "loss_scale": 1.0}\n'


def report(args: list[str]) -> tuple[int, str, str]:
    """``trainfit report ARGS`` in this process: (exit status, stdout, stderr); an exception propagates."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["report", *args])
        except SystemExit as e:  # argparse's refusals
            rc = e.code if isinstance(e.code, int) else 2
    return int(rc or 0), out.getvalue(), err.getvalue()


def errors(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("trainfit: error:")]


def text_of(path: Path) -> str:
    parts: list[str] = []
    parser = HTMLParser()
    parser.handle_data = parts.append
    parser.feed(path.read_text(encoding="utf-8"))
    return " ".join(parts)


def notes_of(path: Path) -> list[str]:
    """The page's notes (one <li class="note"> each)."""
    page = path.read_text(encoding="utf-8")
    return [n.split("</li>")[0] for n in page.split('<li class="note">')[1:]]


def temp_files(*dirs: Path) -> list[str]:
    return [str(p) for d in dirs if d.is_dir() for p in d.iterdir() if p.name.endswith(".tmp")]


def page_of(tmp_path: Path, files: dict[str, str | bytes]) -> tuple[Path, str]:
    """A run dir holding ``files``, reported into tmp/page.html: (the page, its text); asserts exit 0."""
    d = tmp_path / "run"
    d.mkdir(exist_ok=True)
    for name, data in files.items():
        (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    out = tmp_path / "page.html"
    rc, stdout, err = report([str(d), "--out", str(out), "--force"])
    assert rc == 0, err
    assert out.read_text(encoding="utf-8").startswith(PAGE_START)
    assert temp_files(d, tmp_path) == []
    return out, text_of(out)


# -- metrics.jsonl -----------------------------------------------------------------------------------------------

def test_metrics_line_with_a_string_loss_scale_is_skipped_with_its_line_number(tmp_path):
    out, text = page_of(tmp_path, {"metrics.jsonl": GOOD_METRICS + '{"step": 3, "loss": 2.0, "loss_scale": "abc"}\n'})
    assert any(n.startswith("metrics.jsonl line 3: not a metrics record (loss_scale=&#x27;abc&#x27; is not a number)")
               for n in notes_of(out)), notes_of(out)
    assert "optimizer steps 2" in text  # the two good lines are the curve


def test_metrics_value_1e400_is_infinity_drawn_as_a_gap(tmp_path):
    rows = GOOD_METRICS + '{"step": 3, "loss": 1e400, "loss_scale": 1e400}\n{"step": 4, "loss": -1e400}\n'
    out, text = page_of(tmp_path, {"metrics.jsonl": rows})
    assert "optimizer steps 4" in text and "loss curve" in out.read_text()
    s = load_run(tmp_path / "run").loss
    assert math.isnan(s.loss[2]) and math.isnan(s.loss[3]) and math.isnan(s.loss_scale[2])
    assert not s.scaled  # a scale that is not finite is not a scaled run


def test_metrics_huge_integer_loss_is_a_gap_not_an_overflow(tmp_path):
    out, text = page_of(tmp_path, {"metrics.jsonl": GOOD_METRICS + '{"step": 3, "loss": 1%s}\n' % ("0" * 400)})
    assert math.isnan(load_run(tmp_path / "run").loss.loss[2])


@pytest.mark.parametrize("field, value", [("loss", [1, 2]), ("loss_scale", {"a": 1}), ("forward_s", [0.1]),
                                          ("stepped", [True]), ("step_s", "fast")])
def test_metrics_field_that_is_a_list_or_object_skips_the_line(tmp_path, field, value):
    bad = json.dumps({"step": 3, "loss": 1.0, "forward_s": 0.1, "step_s": 0.2, field: value})
    out, _ = page_of(tmp_path, {"metrics.jsonl": GOOD_METRICS + bad + "\n"})
    assert any(n.startswith(f"metrics.jsonl line 3: not a metrics record ({field}=") for n in notes_of(out))


@pytest.mark.parametrize("step", ['"1"', "1.5", "true", "-1", "null", "1" + "0" * 30, "[1]"])
def test_metrics_step_not_a_whole_number_skips_the_line(tmp_path, step):
    out, text = page_of(tmp_path, {"metrics.jsonl": GOOD_METRICS + '{"step": %s, "loss": 1.0}\n' % step})
    assert any(n.startswith("metrics.jsonl line 3: not a metrics record (step=") for n in notes_of(out))
    assert "optimizer steps 2" in text


@pytest.mark.parametrize("line", ["[1, 2]", '"text"', "3", "null", "true"])
def test_metrics_line_that_is_not_an_object_is_skipped(tmp_path, line):
    out, _ = page_of(tmp_path, {"metrics.jsonl": GOOD_METRICS + line + "\n"})
    assert any(n.startswith("metrics.jsonl line 3: not a metrics record (a JSON ") for n in notes_of(out))


def test_metrics_truncated_last_line_is_skipped(tmp_path):
    out, text = page_of(tmp_path, {"metrics.jsonl": GOOD_METRICS + '{"step": 3, "lo'})
    assert "metrics.jsonl line 3: not a metrics record (not JSON); skipped" in notes_of(out)
    assert "optimizer steps 2" in text


def test_empty_metrics_file_writes_a_page_with_a_note(tmp_path):
    out, text = page_of(tmp_path, {"metrics.jsonl": ""})
    assert notes_of(out) == ["metrics.jsonl: empty; no loss curve"]
    assert "Nothing in this directory could be read" in text


def test_metrics_with_only_bad_lines_writes_a_page_with_their_notes(tmp_path):
    out, _ = page_of(tmp_path, {"metrics.jsonl": "garbage\n[]\n"})
    assert notes_of(out)[-1] == "metrics.jsonl: no readable record; no loss curve"
    assert len(notes_of(out)) == 3


def test_metrics_non_utf8_line_is_skipped_and_the_others_kept(tmp_path):
    data = GOOD_METRICS.encode() + b'{"step": 3, "loss": "\xff\xfe"}\n' + b'{"step": 4, "loss": 1.0}\n'
    out, text = page_of(tmp_path, {"metrics.jsonl": data})
    assert "metrics.jsonl line 3: not UTF-8 text; skipped" in notes_of(out)
    assert "optimizer steps 3" in text


def test_many_bad_metrics_lines_are_counted_not_listed_one_by_one(tmp_path):
    out, _ = page_of(tmp_path, {"metrics.jsonl": GOOD_METRICS + "x\n" * 500})
    notes = notes_of(out)
    assert len(notes) == 21 and notes[-1] == "metrics.jsonl: 480 more like these; left out"


# -- memory.json / profile.json / plan.json / verify.json ---------------------------------------------------------

def _wrong(name: str) -> dict[str, str | bytes]:
    """Malformed contents of one report file, by what is wrong with them."""
    doc = DOCS[name][0] if isinstance(DOCS[name], list) else DOCS[name]
    first_int = next(k for k, v in doc.items() if isinstance(v, int) and not isinstance(v, bool))
    nested = next(k for k, v in doc.items() if isinstance(v, (dict, list)) and v)
    return {
        "string where a number goes": json.dumps({**doc, first_int: "12 MiB"}),
        "list of non-objects": json.dumps([1, "two", None, [3]]),
        "nested wrong type": json.dumps({**doc, nested: {"x": [{"y": "z"}]} if isinstance(doc[nested], list)
                                         else [1, 2]}),
        "top-level number": "42",
        "top-level string": '"memory"',
        "NaN token where an int goes": json.dumps({**doc, first_int: math.nan}),
        "Infinity token where an int goes": json.dumps({**doc, first_int: math.inf}),
        "integer beyond 64 bits": json.dumps({**doc, first_int: 10**30}),
        "integer beyond float": json.dumps({**doc, first_int: 10**400}),
        "nested deeper than Python reads": "[" * 100_000 + "]" * 100_000,
        "nested deep in a free-form field": json.dumps(doc)[:-1] + ', "x": ' + "[" * 995 + "]" * 995 + "}",
        "not UTF-8": b"\xff\xfe{" + json.dumps(doc).encode(),
        "truncated": json.dumps(doc)[:50],
        "empty": "",
        "keys that are not text in a reports container": json.dumps({"reports": [{"1": 2}, 3]}),
    }


CASES = [(name, what) for name in DOCS for what in _wrong(name)]


@pytest.mark.parametrize("name, what", CASES, ids=[f"{n}-{w}" for n, w in CASES])
def test_report_file_of_wrong_types_is_left_out_with_a_note(tmp_path, name, what):
    data = _wrong(name)[what]
    out, text = page_of(tmp_path, {"metrics.jsonl": GOOD_METRICS, name: data})
    notes = notes_of(out)
    assert any(n.startswith(name) for n in notes), (what, notes)
    assert all("\n" not in n for n in notes)
    assert "optimizer steps 2" in text  # the rest of the page is still there


def test_nan_and_infinity_tokens_in_float_fields_are_read_and_shown(tmp_path):
    verify = {**VERIFY, "grad_cosine": math.nan, "grad_rel_error": math.inf, "passed": False}
    profile = {**PROFILE, "forward_s": math.inf, "backward_s": math.nan, "mfu": math.nan}
    out, text = page_of(tmp_path, {"verify.json": json.dumps(verify), "profile.json": json.dumps(profile)})
    assert notes_of(out) == []
    assert "nan" in text and "inf" in text  # verify's table shows them as they are
    art = load_run(tmp_path / "run")
    assert math.isnan(art.verify[0].grad_cosine) and "forward" not in [k for k, v in art.profile[0].phases.items()
                                                                          if math.isfinite(v)]


def test_config_toml_that_is_not_utf8_or_is_a_directory_does_not_crash(tmp_path):
    out, text = page_of(tmp_path, {"metrics.jsonl": GOOD_METRICS, "config.toml": b"steps = \xff\n"})
    assert any(n.startswith("config.toml: not UTF-8 text") for n in notes_of(out))
    shutil.rmtree(tmp_path / "run")
    (tmp_path / "run" / "config.toml").mkdir(parents=True)
    out, _ = page_of(tmp_path, {"metrics.jsonl": GOOD_METRICS})
    assert "config.toml: not a regular file; left out" in notes_of(out)


def test_a_report_file_that_is_a_directory_is_left_out(tmp_path):
    (tmp_path / "run" / "memory.json").mkdir(parents=True)
    out, _ = page_of(tmp_path, {"metrics.jsonl": GOOD_METRICS})
    assert "memory.json: not a regular file; left out" in notes_of(out)


def test_text_that_utf8_cannot_hold_is_written_escaped(tmp_path):
    doc = {**VERIFY, "precision": "bf16\ud800"}  # a lone surrogate: legal as a JSON escape, not as UTF-8
    out, text = page_of(tmp_path, {"verify.json": json.dumps(doc)})
    assert "bf16\\ud800" in text


# -- results.from_dict: wrong types are ResultFormatError, never TypeError/ValueError/OverflowError --------------

def _deep(n: int) -> list:
    x: list = []
    for _ in range(n):
        x = [x]
    return x


@pytest.mark.parametrize("kind, doc, message", [
    (MemoryReport, {**MEMORY[0], "peak_bytes": 10**30}, "MemoryReport.peak_bytes: expected int"),
    (VerifyReport, {**VERIFY, "grad_cosine": 10**400}, "VerifyReport.grad_cosine: expected float"),
    (ProfileReport, {**PROFILE, "scaling": {"deep": _deep(3000)}}, "ProfileReport.scaling.deep: nested too deeply"),
    (MemoryReport, {**MEMORY[0], "details": {"deep": _deep(3000)}}, "nested too deeply"),
    (VerifyReport, {1: 2}, "text keys"),
    (PlanReport, {**PLAN, "plans": ["x" * 10_000]}, r"expected a JSON object"),
])
def test_from_dict_rejects_wrong_types_with_result_format_error(kind, doc, message):
    with pytest.raises(ResultFormatError, match=message) as e:
        kind.from_dict(doc)
    assert len(str(e.value)) < 400  # the message quotes the value, not all of it


# -- charts ----------------------------------------------------------------------------------------------------

def test_charts_draw_non_finite_and_huge_values_without_crashing():
    png = b"\x89PNG"
    s = LossSeries(steps=[1, 2, 3, 4, 2**53], loss=[math.nan, 1e308, -1e308, 2.0, math.inf],
                   loss_scale=[0.0, -1.0, math.inf, 1e308, 65536.0], skipped=[1, 3])
    assert plots.loss_png(s).startswith(png) and plots.loss_scale_png(s).startswith(png)
    nan = LossSeries(steps=[1], loss=[math.nan], loss_scale=[math.nan], skipped=[1])
    assert plots.loss_png(nan).startswith(png) and plots.loss_scale_png(nan).startswith(png)
    parts = [{"params": 2**62, "grads": 2**62, "optimizer": 2**62, "activations": 0, "temporaries": 1}] * 2
    assert plots.memory_png(["$\\frac{a", "$x$ same"], parts, [2**62, None]).startswith(png)
    times = [{"forward": math.inf, "backward": math.nan, "rest": 1e300, "data_wait": -1.0}, {"forward": 1e-3}]
    assert plots.time_png(["$a", "b\nc" * 100], times).startswith(png)
    many = [{"forward": 0.1}] * 500
    assert plots.time_png([f"p{i}" for i in range(500)], many).startswith(png)  # capped at MAX_BARS


def test_a_chart_matplotlib_cannot_draw_becomes_a_note(tmp_path, monkeypatch):
    def broken(*a):
        raise ValueError("Axis limits cannot be NaN or Inf")

    monkeypatch.setattr(plots, "loss_png", broken)
    out, text = page_of(tmp_path, {"metrics.jsonl": GOOD_METRICS})
    assert notes_of(out) == ["loss curve chart not drawn (ValueError: Axis limits cannot be NaN or Inf)"]
    assert "optimizer steps 2" in text


def test_many_reports_make_one_page_with_a_capped_chart(tmp_path):
    docs = [{**MEMORY[0], "batch": b} for b in range(1, 61)]
    out, text = page_of(tmp_path, {"memory.json": json.dumps(docs)})
    assert "the first 40 of 60 shown" in text and "batch 60" in text


# -- output path --------------------------------------------------------------------------------------------------

@pytest.fixture
def rr(tmp_path) -> Path:
    d = tmp_path / "rr"
    d.mkdir()
    (d / "metrics.jsonl").write_text(GOOD_METRICS)
    return d


def test_out_onto_an_existing_file_is_refused_without_force_and_replaced_with_it(tmp_path, rr):
    mine = tmp_path / "other.txt"
    mine.write_text("mine\n")
    rc, out, err = report([str(rr), "--out", str(mine)])
    assert rc == 2 and out == "" and len(errors(err)) == 1 and "--force" in errors(err)[0] and "other.txt" in err
    assert mine.read_text() == "mine\n" and sorted(p.name for p in rr.iterdir()) == ["metrics.jsonl"]
    rc, _, err = report([str(rr), "--out", str(mine), "--force"])
    assert rc == 0, err
    assert mine.read_text().startswith(PAGE_START)


def test_out_a_directory_is_refused_and_leaves_no_temp_file(tmp_path, rr):
    outdir = tmp_path / "outdir"
    outdir.mkdir()
    for force in ([], ["--force"]):
        rc, out, err = report([str(rr), "--out", str(outdir), *force])
        assert rc == 2 and len(errors(err)) == 1 and "outdir" in errors(err)[0] and "directory" in errors(err)[0]
        assert list(outdir.iterdir()) == [] and sorted(p.name for p in rr.iterdir()) == ["metrics.jsonl"]
        assert temp_files(tmp_path) == []


def test_out_under_a_file_is_refused(tmp_path, rr):
    (tmp_path / "afile").write_text("x")
    rc, _, err = report([str(rr), "--out", str(tmp_path / "afile" / "page.html")])
    assert rc == 2 and len(errors(err)) == 1 and "afile" in errors(err)[0]


@pytest.mark.parametrize("make", ["missing", "file"])
def test_run_dir_that_does_not_exist_or_is_a_file_names_run_dir(tmp_path, make):
    target = tmp_path / "nope"
    if make == "file":
        target.write_text("mine")
    for extra in ([], ["--out", str(tmp_path / "p.html")]):
        rc, out, err = report([str(target), *extra])
        assert rc == 2 and out == "" and len(errors(err)) == 1 and "run_dir=" in errors(err)[0]
        assert sorted(p.name for p in tmp_path.iterdir()) == ([] if make == "missing" else ["nope"])


def test_default_report_html_is_replaced_in_a_run_dir(tmp_path, rr):
    assert report([str(rr)])[0] == 0
    first = (rr / "report.html").read_text()
    (rr / "metrics.jsonl").write_text(GOOD_METRICS + '{"step": 3, "loss": 1.0}\n')
    assert report([str(rr)])[0] == 0  # trainfit's own page: replaced without --force
    assert (rr / "report.html").read_text() != first and "optimizer steps 3" in text_of(rr / "report.html")
    (rr / MARKER).write_text("")
    (rr / "report.html").write_text("<p>anything</p>")
    assert report([str(rr)])[0] == 0  # a run directory trainfit owns: its report.html is trainfit's
    assert temp_files(rr) == []


def test_default_report_html_of_the_users_is_not_replaced_without_force(tmp_path, rr):
    (rr / "report.html").write_text("<p>my own notes</p>")
    rc, out, err = report([str(rr)])
    assert rc == 2 and len(errors(err)) == 1 and "--force" in errors(err)[0]
    assert (rr / "report.html").read_text() == "<p>my own notes</p>"
    assert report([str(rr), "--force"])[0] == 0
    assert (rr / "report.html").read_text().startswith(PAGE_START)
    (rr / "report.html").unlink()
    (rr / "report.html").mkdir()
    rc, _, err = report([str(rr), "--force"])
    assert rc == 2 and len(errors(err)) == 1 and "report.html" in errors(err)[0]


def test_a_failed_write_leaves_no_temp_file_and_the_old_page_whole(tmp_path, rr, monkeypatch):
    assert report([str(rr)])[0] == 0
    before = (rr / "report.html").read_bytes()

    def full_disk(src, dst):
        raise OSError(28, "No space left on device", str(dst))

    monkeypatch.setattr(os, "replace", full_disk)
    rc, out, err = report([str(rr)])
    assert rc == 2 and len(errors(err)) == 1 and "No space left" in errors(err)[0]
    assert (rr / "report.html").read_bytes() == before
    assert sorted(p.name for p in rr.iterdir()) == ["metrics.jsonl", "report.html"]


def test_report_json_prints_exactly_one_strict_json_object(tmp_path, rr):
    out_path = tmp_path / "p.html"
    rc, out, err = report([str(rr), "--out", str(out_path), "--json"])
    assert rc == 0, err
    assert json.loads(out, parse_constant=lambda t: pytest.fail(t)) == {"report": str(out_path)}
    assert out.count("\n") == 1
    rc, out, err = report([str(rr), "--out", str(out_path), "--json"])  # exists now: refused, nothing on stdout
    assert rc == 2 and out == ""


def test_notes_are_said_once_on_stderr_as_a_warning(tmp_path, rr):
    (rr / "memory.json").write_text("42")
    rc, _, err = report([str(rr), "--out", str(tmp_path / "p.html")])
    assert rc == 0
    warn = [ln for ln in err.splitlines() if ln.startswith("trainfit: warning:")]
    assert len(warn) == 1 and "memory.json" in warn[0]


# -- save_and_report (memory/profile/plan/verify --report) ------------------------------------------------------

def test_save_and_report_writes_strict_json_that_reads_back_non_finite(tmp_path):
    run = tmp_path / "run"
    save_and_report(run, "verify.json", {**VERIFY, "grad_cosine": math.nan, "grad_rel_error": math.inf,
                                         "passed": False}, report=True)
    text = (run / "verify.json").read_text()
    stored = json.loads(text, parse_constant=lambda t: pytest.fail(f"{t} token in stored JSON"))
    assert stored["grad_cosine"] is None and stored["non_finite"] == ["grad_cosine=nan", "grad_rel_error=inf"]
    art = load_run(run)
    assert art.notes == [] and math.isnan(art.verify[0].grad_cosine) and art.verify[0].grad_rel_error == math.inf
    assert "non_finite" not in art.verify[0].extra
    assert (run / MARKER).is_file() and (run / "report.html").is_file() and temp_files(run) == []


def test_save_and_report_lists_non_finite_numbers_per_entry(tmp_path):
    keys = ("precision", "checkpointing")
    a, b = copy.deepcopy(MEMORY)
    save_and_report(tmp_path / "r", "memory.json", {**a, "wall_s": math.nan}, report=False, keep_others=keys)
    save_and_report(tmp_path / "r", "memory.json", {**b, "wall_s": math.inf}, report=False, keep_others=keys)
    stored = json.loads((tmp_path / "r" / "memory.json").read_text(), parse_constant=pytest.fail)
    assert [d["non_finite"] for d in stored] == [["wall_s=nan"], ["wall_s=inf"]]
    art = load_run(tmp_path / "r")
    assert art.notes == [] and math.isnan(art.memory[0].wall_s) and art.memory[1].wall_s == math.inf


@pytest.mark.parametrize("old", [b"\xff\xfe[", b"[1,", b"42", b"[" * 100_000, b'{"reports": [1, {"precision": 3}]}'])
def test_save_and_report_replaces_a_malformed_existing_file(tmp_path, old):
    run = tmp_path / "run"
    run.mkdir()
    (run / MARKER).write_text("")
    (run / "memory.json").write_bytes(old)
    save_and_report(run, "memory.json", MEMORY[0], report=True, keep_others=("precision", "checkpointing"))
    art = load_run(run)
    assert [m.precision for m in art.memory] == ["fp32"]
    assert temp_files(run) == [] and (run / "report.html").is_file()


def test_save_and_report_twice_into_the_same_new_directory(tmp_path):
    run = tmp_path / "new" / "run"
    for doc in MEMORY:
        save_and_report(run, "memory.json", doc, report=False, keep_others=("precision", "checkpointing"))
    assert (run / MARKER).is_file() and len(load_run(run).memory) == 2


# -- property: any malformed run directory -> exit 0 with a page, or 2 with one line; never a traceback ----------

json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**25), 10**25), st.floats(), st.text(max_size=8),
              st.sampled_from([10**400, -(10**30), 2**63, 1e308, "$\\frac{", "\ud800"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=10)


@st.composite
def mutated(draw, doc):
    """``doc`` with one value somewhere inside it (or a key's value at the top) replaced by a random JSON value."""
    doc = copy.deepcopy(doc)
    node, depth = doc, 0
    while True:
        if isinstance(node, dict) and node:
            key = draw(st.sampled_from(sorted(node)))
        elif isinstance(node, list) and node:
            key = draw(st.integers(0, len(node) - 1))
        else:
            return draw(json_value)
        child = node[key]
        if depth < 4 and isinstance(child, (dict, list)) and child and draw(st.booleans()):
            node, depth = child, depth + 1
            continue
        node[key] = draw(json_value)
        return doc


def _dumps(v) -> bytes:
    return json.dumps(v, allow_nan=True).encode("utf-8", "surrogatepass")


def report_file(name: str):
    doc = DOCS[name]
    return st.one_of(
        st.binary(max_size=80),
        json_value.map(_dumps),
        mutated(doc).map(_dumps),
        st.lists(mutated(doc[0] if isinstance(doc, list) else doc), min_size=1, max_size=3).map(_dumps),
        mutated({"reports": doc if isinstance(doc, list) else [doc]}).map(_dumps),
    )


def metrics_file():
    row = fp16_rows()[5]
    line = st.one_of(json_value.map(_dumps), mutated(row).map(_dumps), st.just(_dumps(row)), st.binary(max_size=30))
    return st.lists(line, max_size=6).map(lambda ls: b"\n".join(ls)) | st.binary(max_size=80)


FILES = {"metrics.jsonl": metrics_file(), **{n: report_file(n) for n in DOCS},
         "config.toml": st.binary(max_size=40) | st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass"))}
RUNS = {"examples": 0}


@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(files=st.fixed_dictionaries({}, optional=FILES), as_json=st.booleans())
def test_any_malformed_run_dir_gives_a_page_or_one_error_line_never_a_traceback(files, as_json):
    RUNS["examples"] += 1
    tmp = Path(tempfile.mkdtemp(prefix="tf-report-"))
    try:
        d = tmp / "run"
        d.mkdir()
        for name, data in files.items():
            (d / name).write_bytes(data)
        out = tmp / "x.html"
        rc, stdout, err = report([str(d), "--out", str(out), *(["--json"] if as_json else [])])
        assert "Traceback" not in err
        assert rc in (0, 2), err
        if rc == 0:
            page = out.read_text(encoding="utf-8")
            assert page.startswith(PAGE_START) and page.endswith("</body></html>")
            assert all("\n" not in n for n in notes_of(out))
            for name, data in files.items():  # a file that is not UTF-8 JSON is named on the page
                if name != "metrics.jsonl" and name != "config.toml":
                    try:
                        json.loads(data.decode("utf-8-sig"))
                    except (UnicodeDecodeError, ValueError, RecursionError):
                        assert any(n.startswith(name) for n in notes_of(out)), (name, notes_of(out))
            if as_json:
                assert json.loads(stdout, parse_constant=pytest.fail) == {"report": str(out)}
        else:
            assert len(errors(err)) == 1 and stdout == "" and not out.exists()
            assert not any(n in files for n in ("metrics.jsonl", *DOCS)), err  # refused only with none of them
        assert temp_files(d, tmp) == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
