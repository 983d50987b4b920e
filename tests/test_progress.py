"""Say what you are doing (issue #28 item 7): progress on stderr through ``logging``, ``--quiet`` / ``--verbose``.

Each check reads an independent reference: the pairs a plan was asked for (the product of its flags) and the basis
files its traces wrote to the cache; the memory report's own peak (``--json``); the records a ``logging`` handler of
the test's own receives. A refusal stays one line although progress was said before it (held, then dropped).
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import re

import pytest

import trainfit.progress as progress
from trainfit.cli import main, split_verbosity
from trainfit.config import make_config
from trainfit.errors import ConfigError

TINY = ["--model-config", "n_layer=1,d_model=16,n_head=2", "--seq", "8"]
MEMORY = ["memory", *TINY, "--batch", "2", "--accumulation", "1"]


def _lines(err: str) -> list[str]:
    return [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()]


class _Records(logging.Handler):
    """Every record the ``trainfit`` logger passes on, as (logger name, level, message)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.got: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.got.append((record.name, record.levelno, record.getMessage()))


@pytest.fixture
def records():
    root = logging.getLogger("trainfit")
    handler, level = _Records(), root.level
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


# -- plan: the traced pairs ---------------------------------------------------------------------------------------
PAIR = re.compile(r"^trainfit: plan: traced pair (\d+)/(\d+) \(([\w-]+), ([\w:.-]+), at [\d.]+ s\)$")


@pytest.mark.slow
def test_a_plan_says_each_pair_it_traces_and_verbose_says_the_cached_ones(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINFIT_CACHE_DIR", str(tmp_path / "cache"))  # cold: every pair is traced now
    precisions, checkpointings = ["fp32"], ["none", "full", "selective"]
    argv = ["plan", "--model", "gpt-tiny", "--model-config", "n_layer=2,d_model=32,n_head=2", "--seq", "32",
            "--basis", "fast", "--precisions", ",".join(precisions), "--checkpointings", ",".join(checkpointings),
            "--global-batch", "8", "--device-memory", "1GiB", "--offloads", "none", "--top", "2"]
    assert main(argv) == 0
    said = [m.groups() for m in map(PAIR.match, _lines(capsys.readouterr().err)) if m]
    asked = set(itertools.product(precisions, checkpointings))
    assert [int(n) for n, *_ in said] == list(range(1, len(asked) + 1))  # counted 1..N in the order they end
    assert {int(total) for _, total, *_ in said} == {len(asked)}
    assert {(p, ck) for _, _, p, ck in said} == asked
    assert len(list((tmp_path / "cache" / "basis").glob("*.json"))) == len(asked)  # what was traced, on disk
    # Again: every pair is read from the cache, so none is said traced; --verbose says the cache line (debug).
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert not [ln for ln in _lines(err) if PAIR.match(ln)]
    assert f"{len(asked)} of {len(asked)} (precision, checkpointing) pairs read from the cache" not in err
    assert main([*argv, "--verbose"]) == 0
    assert (f"trainfit: plan: {len(asked)} of {len(asked)} (precision, checkpointing) pairs read from the cache"
            in capsys.readouterr().err)


def test_a_stage_says_the_first_and_last_item_and_rate_limits_the_rest(records):
    logging.getLogger("trainfit").setLevel(logging.DEBUG)
    with progress.stage("demo", 50, verb="tracing pair", every_s=3600) as s:  # a fast loop: nothing in an hour
        for i in range(50):
            s.step(f"item {i}")
    info = [m for name, level, m in records.got if level == logging.INFO]
    debug = [m for name, level, m in records.got if level == logging.DEBUG]
    assert info == ["demo: tracing pair 1/50 (item 0) ...", "demo: tracing pair 50/50 (item 49) ..."]
    assert len(debug) == 48 and debug[0] == "demo: tracing pair 2/50 (item 1) ..."
    assert {name for name, _, _ in records.got} == {"trainfit.demo"}


def test_inside_a_stage_the_work_below_says_its_lines_at_debug(records):
    logging.getLogger("trainfit").setLevel(logging.DEBUG)
    log = progress.logger("memory")
    progress.say(log, "outside")
    with progress.stage("plan", 1, verb="pair") as s:
        s.step()
        progress.say(log, "inside")
    assert [(m, lv) for _, lv, m in records.got] == [("outside", logging.INFO), ("plan: pair 1/1", logging.INFO),
                                                     ("inside", logging.DEBUG)]


# -- memory --measure: the measured step; --quiet, --verbose ------------------------------------------------------
def test_memory_measure_says_its_steps_and_quiet_says_nothing(capsys):
    assert main([*MEMORY, "--json"]) == 0
    out, err = capsys.readouterr()
    peak = json.loads(out)["peak_bytes"]
    lines = _lines(err)
    building = [i for i, ln in enumerate(lines) if ln.startswith("trainfit: memory: building the run (gpt-tiny")]
    measuring = [i for i, ln in enumerate(lines) if ln.startswith("trainfit: memory: measuring one step "
                                                                  "(micro-batch 2 x accumulation 1)")]
    measured = [ln for ln in lines if ln.startswith("trainfit: memory: measured in ")]
    assert building and measuring and building[0] < measuring[0], err
    assert any(f"peak {peak:,} bytes" in ln for ln in measured), (peak, measured)  # the report's own peak
    assert "batch scaling from the reports already made" not in err  # a debug line
    for argv in (["--quiet", *MEMORY, "--json"], [*MEMORY, "--json", "--quiet"]):  # before or after the command
        assert main(argv) == 0
        out, err = capsys.readouterr()
        assert err == "" and json.loads(out)["peak_bytes"] == peak, err


def test_verbose_shows_debug_lines(capsys):
    assert main(["--verbose", *MEMORY]) == 0
    err = capsys.readouterr().err
    assert "trainfit: memory: batch scaling from the reports already made at micro-batches 2, 4" in err
    assert "trainfit: memory: measuring one step" in err


def test_the_environment_sets_the_level_and_a_flag_wins(capsys, monkeypatch):
    monkeypatch.setenv("TRAINFIT_VERBOSITY", "quiet")  # what `train --devices N` hands its workers
    assert main(MEMORY) == 0
    assert capsys.readouterr().err == ""
    assert main([*MEMORY, "--verbose"]) == 0
    assert "batch scaling from the reports already made" in capsys.readouterr().err
    monkeypatch.setenv("TRAINFIT_VERBOSITY", "loud")
    assert main(MEMORY) == 2
    assert _lines(capsys.readouterr().err) == [
        "trainfit: error: TRAINFIT_VERBOSITY='loud' is not valid; allowed: one of: quiet, normal, verbose "
        "(or pass --quiet / --verbose)"]


def test_quiet_and_verbose_together_are_refused_in_one_line(capsys):
    assert main(["--quiet", *MEMORY, "--verbose"]) == 2
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("trainfit: error: verbosity='--quiet --verbose'"), lines


def test_the_flags_are_taken_wherever_they_stand_but_not_after_a_double_dash():
    assert split_verbosity(["--quiet", "plan", "--seq", "8"]) == (["plan", "--seq", "8"], "quiet")
    assert split_verbosity(["plan", "--seq", "8", "--verbose"]) == (["plan", "--seq", "8"], "verbose")
    assert split_verbosity(["plan", "--", "--quiet"]) == (["plan", "--", "--quiet"], None)
    with pytest.raises(ConfigError):
        split_verbosity(["--verbose", "plan", "--quiet"])


# -- a refusal is one line, though progress was said before it --------------------------------------------------
@pytest.mark.parametrize("flag", [[], ["--verbose"]])
def test_a_refusal_after_progress_is_still_one_line(capsys, records, flag):
    # n_head=3 does not divide d_model=16: refused when the run is built, after "memory: building the run" was said
    argv = ["memory", "--model-config", "n_layer=1,d_model=16,n_head=3", "--seq", "8", "--batch", "2", *flag]
    assert main(argv) == 2
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("trainfit: error: model_config.n_head=3"), lines
    said = [m for _, _, m in records.got]
    assert any(m.startswith("memory: building the run") for m in said), said  # said, held, dropped


def test_train_says_its_startup_once_accepted_and_quiet_drops_it_with_the_bar(capsys, tmp_path):
    argv = ["train", *TINY, "--micro-batch", "2", "--accumulation", "1", "--steps", "2", "--checkpoint-every", "0"]
    assert main([*argv, "--run-dir", str(tmp_path / "a")]) == 0
    lines = _lines(capsys.readouterr().err)
    order = [next((i for i, ln in enumerate(lines) if ln.startswith(p)), None) for p in (
        "trainfit: train: building the model and reading the data (gpt-tiny", "trainfit: train: built in ",
        "trainfit: train: step 1 of 2 next")]
    assert None not in order and order == sorted(order), lines
    assert main([*argv, "--run-dir", str(tmp_path / "b"), "--quiet"]) == 0
    lines = _lines(capsys.readouterr().err)
    assert not [ln for ln in lines if ln.startswith("trainfit: train:") or "step/s" in ln or "%|" in ln], lines


# -- from Python: silent by default, routed by a handler ---------------------------------------------------------
def test_from_python_nothing_is_printed_and_a_handler_receives_the_messages(capsys, records):
    from trainfit.probes.memory import measure_memory

    cfg = make_config({"model_config": "n_layer=1,d_model=16,n_head=2", "seq_len": 8, "micro_batch": 2})
    assert logging.getLogger("trainfit").level == logging.NOTSET  # as a library user finds it
    report = measure_memory(cfg)
    assert capsys.readouterr().err == ""  # no configuration: nothing printed
    assert records.got == []  # and nothing emitted: the root's WARNING stands
    logging.getLogger("trainfit").setLevel(logging.INFO)
    again = measure_memory(cfg)
    assert capsys.readouterr().err == ""  # the user's handler has it, not stderr
    names = {name for name, _, _ in records.got}
    said = [m for _, _, m in records.got]
    assert names == {"trainfit.memory"}
    assert any(m == f"memory: measured in {again.wall_s:.1f} s: peak {again.peak_bytes:,} bytes in "
               f"{again.peak_phase}" for m in said), said
    assert again.peak_bytes == report.peak_bytes


def test_the_cli_handler_writes_to_the_stderr_of_the_moment_and_is_removed_after(capsys):
    log = progress.logger("demo")
    before = list(logging.getLogger("trainfit").handlers)
    with progress.to_stderr(progress.NORMAL):
        import sys

        real, sys.stderr = sys.stderr, io.StringIO()
        try:
            log.info("demo: now")
            log.warning("demo: careful")
            log.debug("demo: hidden")
            caught = sys.stderr.getvalue()
        finally:
            sys.stderr = real
    assert caught == "trainfit: demo: now\ntrainfit: warning: demo: careful\n"
    assert logging.getLogger("trainfit").handlers == before
    log.info("demo: after")  # no handler of the CLI's left: nothing printed
    assert capsys.readouterr().err == ""


def test_bars_follow_the_logger_level():
    root = logging.getLogger("trainfit")
    level = root.level
    try:
        root.setLevel(logging.NOTSET)
        assert progress.bars_enabled()
        root.setLevel(logging.WARNING)
        assert not progress.bars_enabled()
        root.setLevel(logging.DEBUG)
        assert progress.bars_enabled()
    finally:
        root.setLevel(level)


# -- profile: its phases and steps ---------------------------------------------------------------------------------
def test_profile_says_each_step_it_runs(capsys):
    argv = ["profile", *TINY, "--micro-batch", "2", "--accumulation", "1", "--steps", "2", "--warmup", "1",
            "--no-batch-probe", "--no-precision-probe", "--bandwidth", "1GB/s", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    total = report["warmup"] + report["steps"]  # what the report says it ran
    steps = [ln for ln in _lines(err) if ln.startswith("trainfit: profile: step ")]
    every = [f"trainfit: profile: step {i}/{total} ({'warm-up' if i <= report['warmup'] else 'timed'})"
             for i in range(1, total + 1)]
    # the first and the last always; one in between only a second after the last line said (rate-limited)
    assert steps[0] == every[0] and steps[-1] == every[-1] and all(ln in every for ln in steps), steps
    assert [every.index(ln) for ln in steps] == sorted({every.index(ln) for ln in steps}), steps
    assert any(ln.startswith("trainfit: profile: predicting scale-out (bandwidth given)") for ln in _lines(err))
    assert main([*argv, "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_a_commands_info_lines_go_through_logging_and_quiet_drops_them(capsys):
    """The commands' own info lines (here plan's echo of another tool's precision spelling) are log records:
    said by default, gone under --quiet, while the answer on stdout is the same."""
    from trainfit.cli import main

    base = ["plan", "--global-batch", "8", "--device-memory", "80GiB", "--basis", "analytic", "--precisions", "bf16",
            "--json"]
    assert main(base) == 0
    said = capsys.readouterr()
    assert "trainfit: precision bf16" in said.err and "is bf16-mixed" in said.err
    assert main([*base, "--quiet"]) == 0
    quiet = capsys.readouterr()
    import json

    assert quiet.err == "" and json.loads(quiet.out)["plans"] == json.loads(said.out)["plans"]
