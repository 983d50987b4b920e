"""Issue 18: train, memory and profile pointed at one run directory tell one story on one page.

Every section names the configuration it was measured on; a section measured on another configuration than
the run's config.toml says so, with the difference spelled out; numbers are written for people (thousands
separators and units, never ``1.364e+04``).
"""

import json
import re
import shutil
from html.parser import HTMLParser

import pytest

from trainfit.cli import main
from trainfit.report.data import load_run
from trainfit.report.html import write_report
from trainfit.report.numbers import fmt_ms, fmt_num, fmt_rate, fmt_seconds, fmt_share

from .conftest import PROFILE

pytest.importorskip("matplotlib")

TINY = ["--model-config", "n_layer=1,d_model=32,n_head=2", "--seq", "16", "--micro-batch", "2", "--accumulation", "2"]
SCIENTIFIC = re.compile(r"\d\.\d+e[+-]\d+", re.IGNORECASE)


class _Text(HTMLParser):
    """The page's visible text, split into its sections (one per ``<h2>``; the part before the first is "")."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, list[str]] = {"": []}
        self._current, self._in_h2, self._skip = "", False, 0

    def handle_starttag(self, tag, attrs):
        if tag == "h2":
            self._in_h2, self._current = True, ""
        elif tag in ("style", "script"):
            self._skip += 1

    def handle_endtag(self, tag):
        if tag == "h2":
            self._in_h2 = False
            self.sections.setdefault(self._current, [])
        elif tag in ("style", "script"):
            self._skip -= 1

    def handle_data(self, data):
        if self._skip:
            return
        if self._in_h2:
            self._current += data
        else:
            self.sections.setdefault(self._current, []).append(data)


def sections_of(path) -> dict[str, str]:
    p = _Text()
    p.feed(path.read_text())
    return {k: " ".join(" ".join(v).split()) for k, v in p.sections.items()}


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    """The issue's three commands, run for real in one directory (the tiny model given to train only)."""
    root = tmp_path_factory.mktemp("story")
    rr = root / "rr"
    assert main(["train", "--steps", "20", "--precision", "fp16-mixed", "--run-dir", str(rr), "--report", *TINY]) == 0
    assert main(["memory", "--run-dir", str(rr), "--report"]) == 0
    assert main(["profile", "--steps", "4", "--run-dir", str(rr), "--report", "--no-batch-probe",
                 "--no-precision-probe", "--warmup", "1"]) == 0
    return rr


def test_every_section_names_the_runs_configuration(story):
    memory = json.loads((story / "memory.json").read_text())
    profile = json.loads((story / "profile.json").read_text())
    # memory and profile took the run's configuration from rr/config.toml (no flag gave it)
    assert memory["precision"] == profile["precision"] == "fp16-mixed"
    assert (memory["batch"], memory["accumulation"], memory["strategy"], memory["world_size"]) == (2, 2, "single", 1)
    assert (profile["accumulation"], profile["batch_probe"]["micro_batch"]) == (2, 2)

    sections = sections_of(story / "report.html")
    assert {"Loss", "Memory", "Step time", "Configuration"} <= set(sections)
    for name, text in sections.items():
        if name == "Notes":  # files left out, not measurements
            continue
        assert "fp16-mixed" in text, name
    full = ("precision=fp16-mixed, micro_batch=2, accumulation=2, checkpointing=none, strategy=single, "
            "world_size=1")
    assert f"Trained with: {full}" in sections["Loss"]
    assert f"measured with {full} -- the run's configuration" in sections["Memory"]
    # the Step time section puts profile and training-log bars side by side: each says what it was measured on
    step = sections["Step time"]
    assert f"profile 1: measured with {full} -- the run's configuration" in step
    assert f"train (metrics.jsonl): measured with {full} -- the run's configuration" in step
    assert "differs" not in " ".join(sections.values())  # one configuration throughout


def test_an_overriding_flag_is_labelled_with_the_difference(story, tmp_path):
    rr = tmp_path / "rr"
    shutil.copytree(story, rr)
    assert main(["memory", "--run-dir", str(rr), "--report", "--precision", "fp32"]) == 0
    memory = sections_of(rr / "report.html")["Memory"]
    assert "memory 2 (fp32 / none / batch 2 (measured)): measured with precision=fp32 (the run: fp16-mixed)" in memory
    assert "a different configuration from the run's" in memory
    # the fp16-mixed entry stays, unmarked; the table says which row differs
    assert "memory 1 (fp16-mixed / none / batch 2 (measured)): measured with precision=fp16-mixed" in memory
    assert memory.count("precision=fp32 (the run: fp16-mixed)") == 2  # the line and the table's "vs the run"
    page = (rr / "report.html").read_text()
    assert page.count('class="cfg differs"') == 1


def test_profile_beside_the_training_log_is_marked_when_configurations_differ(tmp_path):
    """The issue's chart: a profile (here bf16-mixed, micro-batch 8 x 4) beside an fp16-mixed training log."""
    (tmp_path / "config.toml").write_text('precision = "fp16-mixed"\nmicro_batch = 2\naccumulation = 2\n'
                                          'checkpointing = "none"\nstrategy = "single"\ndevices = 1\n')
    rows = [{"step": i, "loss": 5.0, "stepped": True, "loss_scale": 65536.0, "forward_s": 4.0, "backward_s": 13.64,
             "backward_sync_s": 0.0, "optimizer_s": 0.5, "data_wait_s": 0.01, "step_s": 18.2} for i in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    step = sections_of(write_report(tmp_path))["Step time"]
    assert ("profile 1: measured with precision=bf16-mixed (the run: fp16-mixed); micro_batch=8 (the run: 2); "
            "accumulation=4 (the run: 2)") in step
    assert "not comparable" in step
    assert "13,640" in step and "1.364e+04" not in step  # the training log's backward, in ms
    assert load_run(tmp_path).setup.precision == "fp16-mixed"


def test_no_number_on_the_page_is_in_scientific_notation(story, run_dir):
    for path in (story / "report.html", write_report(run_dir)):  # run_dir: plan and verify sections too
        text = " ".join(sections_of(path).values())
        assert SCIENTIFIC.findall(text) == [], path
    verify = sections_of(write_report(run_dir))["Verify"]
    assert "0.0061" in verify and "0.02" in verify  # grad_rel_error 6.1e-3 and the update error 2.0e-2


def test_numbers_are_formatted_for_people():
    # chosen: a step-time phase reads in ms in tables and on bars (one unit across bars); a lone duration
    # (a plan's step time) in the unit that reads best
    assert fmt_ms(13.64) == "13,640 ms"
    assert fmt_seconds(13.64) == "13.6 s" and fmt_seconds(0.238) == "238 ms"
    assert fmt_num(13640.0) == "13,640" and fmt_num(65536) == "65,536" and fmt_num(5.51012) == "5.51"
    assert fmt_num(999.7) == "1,000" and fmt_num(0.0061) == "0.0061" and fmt_num(0.0) == "0"
    assert fmt_num(6.1e-6) == "6.1 × 10⁻⁶" and fmt_num(2.5e18) == "2.5 × 10¹⁸"
    assert fmt_num(float("nan")) == "NaN" and fmt_num(None) == "-"
    assert fmt_rate(1111.4, "tokens") == "1,111 tokens/s" and fmt_share(0.33) == "33%"
    for v in (1.364e4, 1e-9, 1e300, 123456789.0, 2**62):
        assert not SCIENTIFIC.search(fmt_num(v)) and "e+" not in fmt_num(v) and "e-" not in fmt_num(v)
