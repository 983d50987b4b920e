"""Shared fixtures, and the suite's tiers.

Every test carries one tier marker (registered in pyproject.toml), set here from its path so that no test file
has to remember it:

- ``pure``: no torch step (tables, arithmetic, parsing, the planner's pure core, the report from JSON);
- ``numeric``: the default, results of real torch steps checked against plain PyTorch or a hand calculation;
- ``cli``: end to end through a separate process (``python -m trainfit``, torchrun, a SIGKILLed run, a browser);
- ``distributed`` (2 gloo processes) and ``slow`` (over ~5 s of CPU) are added on top, here or in the file.

``hf`` is added to every test that imports transformers or peft (its module, its source, or a fixture).

``pytest --fast`` is the edit loop's tier: it leaves out ``slow``, ``distributed``, ``cli`` and ``hf`` tests and runs
each property test (hypothesis) with a quarter of its examples. The full suite (CI, ``.ci/run``) runs everything at
the full example counts, in two pytest-xdist worker processes (``-n 2 --dist loadfile``, one per core of the CI
machine; each test file runs whole in one worker, so a module's fixtures are built once). Each worker runs torch on
one thread, and so do the processes its tests start: threads that outnumber the cores spin against each other. The
``alone`` tests, which compare measured times, run with the machine to themselves (two file locks shared by the
workers, :func:`pytest_runtest_protocol`). ``-m pure`` and the like select one tier.
"""

import atexit
import functools
import inspect
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

# Deterministic, and polite on a shared 2-core machine.
torch.manual_seed(0)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
if _WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = "1"  # processes the tests start inherit one thread each

TINY = "n_layer=2,d_model=32,n_head=2"

PURE = (
    "tests/test_architecture.py", "tests/test_vocabulary.py", "tests/test_data.py",
    "tests/plan/test_comm.py", "tests/plan/test_plan_pure.py", "tests/probes/test_advice.py",
    "tests/report/test_results.py", "tests/report/test_loss_chart.py", "tests/distributed/test_compat.py",
    "tests/test_config.py",
)
"""Files (or node ids) whose tests run no torch step."""

NOT_PURE = ("tests/test_config.py::test_a_trained_run_dir_config_is_sectioned_and_resumes_without_the_note",)
"""Tests in a PURE file that do step (they are numeric)."""

CLI = (
    "tests/test_real_job.py", "tests/test_readme.py::test_readme_library_example_runs",
    "tests/distributed/test_torchrun.py", "tests/reliability/test_sigkill.py::test_sigkill_at_random",
    "tests/loop/test_resume_cli.py::test_default_job_killed", "tests/report/test_chromium.py",
    "tests/reliability/test_checkpoint_faults.py::test_real_full_disk_tmpfs",
    "tests/plan/test_plan_cli.py::test_a_plan_that_traces_nothing_imports_neither",
)
"""Tests where the separate process is what is tested (everything else calls ``trainfit.cli.main`` in-process)."""

DISTRIBUTED = ("tests/distributed/test_offload_zero3.py",)
"""Tests that spawn gloo ranks without saying so in their file."""

SLOW = (
    "tests/test_real_job.py", "tests/reliability/test_sigkill.py::test_sigkill_at_random",
    "tests/reliability/test_every_input.py::test_flags_of_the_run_commands",
    "tests/plan/test_fast_basis.py", "tests/test_train.py::test_loss_falls_on_the_default_task",
    "tests/test_verify_compile.py::test_compiled_step_passes_against_the_noise_floor",
    "tests/levers/test_compile.py::test_inductor_on_cpu_equals_plain_pytorch",
    "tests/levers/test_compile.py::test_compiled_composes_with_checkpointing_and_bf16_mixed",
    "tests/levers/test_compile.py::test_compiled_blocks_equal_eager_and_do_not_recompile_over_20_steps",
    "tests/levers/test_compile.py::test_memory_under_compile_says_the_parts_are_eager",
    "tests/probes/test_profile.py::test_tiny_micro_batch_is_batch_bound_and_the_suggestion_fits",
    "tests/report/test_one_story.py", "tests/loop/test_loop.py::test_resume_with_eval_on_is_bitwise",
    "tests/loop/test_resume_cli.py::test_resume_auto_starts_fresh_then_resumes_bitwise",
    "tests/reliability/test_input_regressions.py::test_a_run_refused_after_validation_leaves_no_directory",
)
"""Tests over ~5 s of CPU each (measured per test on this 2-core machine) that are not marked in their file."""

ALONE = (
    "tests/probes/test_profile_distributed.py", "tests/probes/test_calibrate_bounded.py",
    "tests/probes/test_profile.py::test_tiny_micro_batch_is_batch_bound_and_the_suggestion_fits",
    "tests/meters/test_hardware.py", "tests/plan/test_plan_inputs.py",
    "tests/plan/test_plan_pure.py::test_paper_scale_70b_on_1024_h100_in_seconds",
    "tests/plan/test_plan_cli.py::test_plan_calibrate_on_several_cpu_devices_prices_the_measured_overhead",
    "tests/plan/test_plan_cli.py::test_dist_calibration_measures_on_two_gloo_processes",
    "tests/reliability/test_input_regressions.py::test_plan_answers_fast_for_a_huge_global_batch",
    "tests/reliability/test_input_regressions.py::test_profile_output_paths_are_checked_before_profiling",
)
"""Tests that compare a measured time with a prediction or a bound in seconds: ``alone``. Under
pytest-xdist each runs with the machine to itself (:func:`pytest_runtest_protocol`: the other worker's current test
ends first and no other starts beside it); the other tests run two at a time."""

HF_FIXTURES = {"transformers", "llama_dir", "saved_llama", "model_dir"}
"""Fixtures that build or load a Hugging Face model: their tests are ``hf`` too."""

FAST_LEAVES_OUT = ("slow", "distributed", "cli", "hf")
FAST_EXAMPLES = 4
"""``--fast`` runs each property test with 1/FAST_EXAMPLES of its examples (at least 5)."""


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the edit loop's tier: no slow, distributed, cli or hf tests; property tests at 1/4 of "
                          "their examples")


def _tier(nodeid: str) -> list[str]:
    marks = [name for name, where in (("pure", PURE), ("cli", CLI), ("distributed", DISTRIBUTED), ("slow", SLOW))
             if nodeid.startswith(where) and not (name == "pure" and nodeid.startswith(NOT_PURE))]
    marks += ["alone"] if nodeid.startswith(ALONE) else []
    return marks if {"pure", "cli"} & set(marks) else ["numeric", *marks]


@functools.cache
def _imports_transformers_at_the_top(path: str) -> bool:
    return re.search(r"^(import transformers|from transformers |\w+ = pytest.importorskip\(\"transformers\"\))",
                     Path(path).read_text(), re.MULTILINE) is not None


def _needs_transformers(item) -> bool:
    """``hf``: the test (its module, its own source, or a fixture it takes) imports transformers or peft."""
    fn = getattr(item, "function", None)
    if fn is None:
        return False
    if _imports_transformers_at_the_top(str(item.path)) or HF_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return "transformers" in source or "peft" in source


def _fewer_examples(fn) -> None:
    """A quarter of the examples of a hypothesis test (its own settings otherwise kept)."""
    from hypothesis import settings

    full = getattr(fn, "_trainfit_full_settings", None) or getattr(fn, "_hypothesis_internal_use_settings", None)
    if full is None or not hasattr(fn, "hypothesis"):
        return
    fn._trainfit_full_settings = full
    fn._hypothesis_internal_use_settings = settings(full, max_examples=max(5, full.max_examples // FAST_EXAMPLES))


def pytest_ignore_collect(collection_path, config):
    """``--fast`` does not even import a module that imports transformers at its top (seconds per module)."""
    if config.getoption("--fast") and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return _imports_transformers_at_the_top(str(collection_path)) or None
    return None


@pytest.hookimpl(tryfirst=True)  # before -m reads the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in _tier(item.nodeid) + (["hf"] if _needs_transformers(item) else []):
            item.add_marker(name)
    if not config.getoption("--fast"):
        return
    left_out = {i.nodeid for i in items if any(i.get_closest_marker(m) for m in FAST_LEAVES_OUT)}
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid in left_out])
    items[:] = [i for i in items if i.nodeid not in left_out]
    for item in items:
        _fewer_examples(getattr(item, "obj", None))


@pytest.fixture
def tiny_gpt_overrides() -> str:
    return TINY


@pytest.fixture(autouse=True, scope="session")
def _basis_cache(tmp_path_factory):
    """The planner's basis cache (probes.fastbasis) in a directory of this test session, not ~/.cache."""
    os.environ["TRAINFIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("trainfit-cache"))
    yield


@pytest.fixture(autouse=True)
def _no_accelerate_state_between_tests():
    """Accelerate keeps one process-wide state (the HF Trainer starts it too); a test starts and ends without it.

    Under pytest-xdist any test may follow one that built a Trainer or an Accelerator in the same worker, and
    ``Accelerator(mixed_precision=...)`` refuses to change a state already set.
    """
    _reset_accelerate_state()
    yield
    _reset_accelerate_state()


def _reset_accelerate_state() -> None:
    state = sys.modules.get("accelerate.state")  # never imported here: a test that needs it imports it
    if state is not None:
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()
        state.PartialState._reset_state()


def _warning_to_stderr(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@pytest.fixture
def trainfit_cli(capfd):
    """``trainfit ARGS`` in this process, answered like ``subprocess.run(..., capture_output=True, text=True)``.

    Its stdout and stderr are what the command wrote (file descriptors 1 and 2 too: capfd); a warning is
    printed on that stderr as the command line prints it (one line), not collected by pytest, so "exactly one
    line on stderr" means the same here as in a separate process. An exception escaping ``main`` propagates
    (in a separate process it would be a traceback).
    """
    from trainfit.cli import main

    def run(*args: str) -> subprocess.CompletedProcess:
        capfd.readouterr()
        formatwarning = warnings.formatwarning
        with warnings.catch_warnings():
            warnings.showwarning = _warning_to_stderr
            try:
                rc = main([str(a) for a in args])
            except SystemExit as e:  # argparse's own refusals
                rc = e.code if isinstance(e.code, int) else 2
            finally:
                warnings.formatwarning = formatwarning
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["trainfit", *args], int(rc or 0), out, err)

    return run


class _Machine:
    """Two file locks shared by the xdist workers of one run. ``turn`` is taken by each test on its way in;
    ``machine`` is shared by ordinary tests and taken whole by ``alone`` ones, which keep ``turn`` too (so no new
    test starts beside them) until the last of a run of consecutive ``alone`` tests ends."""

    def __init__(self, run_id: str):
        import tempfile

        root = Path(tempfile.gettempdir()) / f"trainfit-tests-{run_id}"
        root.mkdir(exist_ok=True)
        self.turn, self.machine = open(root / "turn.lock", "a"), open(root / "machine.lock", "a")  # noqa: SIM115
        self.whole = False
        atexit.register(self.turn.close)  # held for the worker's life, closed as it exits
        atexit.register(self.machine.close)


@functools.cache
def _machine(run_id: str) -> _Machine:
    """This worker's locks for the run ``run_id`` (opened once)."""
    return _Machine(run_id)


def _alone(item) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run_id:
        yield
        return
    import fcntl

    m = _machine(run_id)
    if _alone(item) and not m.whole:
        fcntl.flock(m.turn, fcntl.LOCK_EX)
        fcntl.flock(m.machine, fcntl.LOCK_EX)  # waits for the other worker's current test
        m.whole = True
    elif not _alone(item):
        fcntl.flock(m.turn, fcntl.LOCK_EX)
        fcntl.flock(m.machine, fcntl.LOCK_SH)
        fcntl.flock(m.turn, fcntl.LOCK_UN)
    try:
        yield
    finally:
        if not m.whole or not _alone(nextitem):
            fcntl.flock(m.machine, fcntl.LOCK_UN)
            if m.whole:
                fcntl.flock(m.turn, fcntl.LOCK_UN)
                m.whole = False
