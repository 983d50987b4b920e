"""The front door (issue 29 item 1): each command's work as a library call, typed request in, typed report out,
equal to what the command prints with ``--json`` for the same job."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainfit.errors import ConfigError
from trainfit.results import PlanReport


# -- trainfit.front.plan: plan(...) -> PlanReport ---------------------------------------------------------------------
PLAN_JOB = dict(model="gpt-tiny", global_batch=32, seq_len=64, device_memory="80GiB", device="h100", devices=8)
PLAN_FLAGS = ["--model", "gpt-tiny", "--global-batch", "32", "--seq", "64", "--device-memory", "80GiB",
              "--device", "h100", "--devices", "8"]


def _without_timing(notes) -> list[str]:
    """The notes less the basis line, which says how long the traces took and how many came from the cache."""
    return [n for n in notes if not n.startswith("basis: fast fake-tensor traces")]


def test_plan_returns_the_report_plan_json_prints():
    from trainfit.front.plan import PlanRequest, plan

    report = plan(**PLAN_JOB)
    done = subprocess.run([sys.executable, "-m", "trainfit", "plan", *PLAN_FLAGS, "--json"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = PlanReport.from_dict(json.loads(done.stdout))
    assert isinstance(report, PlanReport) and report.plans and report.best is not None
    assert report.plans == printed.plans  # every row: levers, memory by part, step time, reasons
    assert (report.model, report.global_batch, report.devices, report.device_memory_bytes, report.basis,
            report.candidates, dict(report.excluded)) == \
        (printed.model, printed.global_batch, printed.devices, printed.device_memory_bytes, printed.basis,
         printed.candidates, dict(printed.excluded))
    assert _without_timing(report.notes) == _without_timing(printed.notes)
    assert report.device_memory_bytes == 80 * 2**30 and report.devices == 8
    # the typed request is the same call; a field beside it replaces the request's own
    request = PlanRequest(**PLAN_JOB)
    assert plan(request).plans == report.plans
    assert plan(request, top=2).plans == report.plans[:2]


@pytest.mark.parametrize("field, value, named", [
    ("global_batch", 0, "global-batch"), ("devices", "two", "devices"), ("nodes", 0, "nodes"),
    ("device_memory", "lots", "device-memory"), ("headroom", 1.5, "headroom"), ("precisions", "fp8", "precisions"),
    ("device", "tpu9", "device"), ("top", 0, "top"), ("seq_len", 1, "seq"), ("basis", "guess", "basis"),
    ("batch_size", 8, "batch_size"),
])
def test_plan_refuses_a_bad_field_naming_it(field, value, named):
    from trainfit.front.plan import PlanRequest, plan

    with pytest.raises(ConfigError) as refused:
        plan(**{**PLAN_JOB, field: value})
    assert refused.value.field == named and f"{named}={value!r}" in str(refused.value)
    assert "\n" not in str(refused.value)
    if field != "batch_size":  # the typed request refuses it when built, before any work
        with pytest.raises(ConfigError, match=f"^{named}="):
            PlanRequest(**{**PLAN_JOB, field: value})


def test_plan_request_is_frozen_and_checked():
    import dataclasses

    from trainfit.front.plan import PlanRequest

    request = PlanRequest(**{**PLAN_JOB, "devices": "4", "nodes": 2, "precisions": "16-mixed,bf16-mixed"})
    assert (request.devices, request.nodes, request.world_size, request.device_memory) == (4, 2, 8, 80 * 2**30)
    assert request.precisions == ("fp16-mixed", "bf16-mixed") and request.alias_notes  # Lightning's spelling
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.devices = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        PlanRequest("gpt-tiny")  # type: ignore[misc]  # keyword-only
# -- end of trainfit.front.plan ---------------------------------------------------------------------------------------


# -- trainfit.front.memory / profile / train / prepare (helper B) ----------------------------------------------------
TINY_JOB = dict(model="gpt-tiny", model_config="n_layer=2,d_model=32,n_head=2", seq_len=16, micro_batch=2,
                accumulation=1)
TINY_FLAGS = ["--model", "gpt-tiny", "--model-config", "n_layer=2,d_model=32,n_head=2", "--seq", "16",
              "--micro-batch", "2", "--accumulation", "1"]
MEMORY_KEYS = ("n_params", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temporaries_bytes",
               "peak_bytes", "peak_phase", "world_size", "strategy")


def _memory_keys(d: dict) -> dict:
    return {k: d[k] for k in (*MEMORY_KEYS, "activations_per_sample_bytes")}


def test_estimate_memory_equals_the_cli_json_and_counts_4_bytes_per_parameter(trainfit_cli):
    from trainfit.config import RunConfig
    from trainfit.front.memory import estimate_memory
    from trainfit.results import MemoryReport
    from trainfit.run import task_of

    report = estimate_memory(**TINY_JOB, strategy="zero3", devices=4, nodes=2, budget="1MiB")
    done = trainfit_cli("memory", "--estimate", *TINY_FLAGS, "--strategy", "zero3", "--devices", "8",
                        "--budget", "1MiB", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    printed = json.loads(done.stdout)
    assert isinstance(report, MemoryReport) and report.world_size == 8
    assert _memory_keys(report.to_dict()) == _memory_keys(printed)
    assert report.extra["max_micro_batch"] == printed["max_micro_batch"]
    # A hand-checked number: fp32 weights on one device are 4 bytes per parameter torch counts in the model.
    single = estimate_memory(**TINY_JOB)
    model = task_of(RunConfig(**TINY_JOB)).build_model()
    n = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    assert single.params_bytes == 4 * n and single.n_params == sum(p.numel() for p in model.parameters())


def test_measure_memory_equals_the_cli_json(trainfit_cli):
    from trainfit.front.memory import measure_memory

    report = measure_memory(**TINY_JOB)
    done = trainfit_cli("memory", *TINY_FLAGS, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert report.method == "measured"
    assert _memory_keys(report.to_dict()) == _memory_keys(json.loads(done.stdout))


def test_memory_front_door_refuses_as_the_cli_does(trainfit_cli):
    from trainfit.front.memory import estimate_memory

    for kwargs, flags, field in (({"nodes": 0}, ["--nodes", "0"], "nodes"),
                                 ({"micro_batch": 0}, ["--micro-batch", "0"], "micro_batch"),
                                 ({"compile_mode": "max-autotune"}, ["--compile-mode", "max-autotune"], "compile_mode")):
        with pytest.raises(ConfigError) as e:
            estimate_memory(**{**TINY_JOB, **kwargs})
        base = [a for i, a in enumerate(TINY_FLAGS) if TINY_FLAGS[i - i % 2] not in flags]  # each flag once
        done = trainfit_cli("memory", "--estimate", *base, *flags)
        assert done.returncode == 2 and done.stderr.strip() == f"trainfit: error: {e.value}"
        assert field in str(e.value) and "\n" not in str(e.value)


def test_profile_returns_the_report_of_the_profiled_job():
    from trainfit.front.profile import profile
    from trainfit.results import ProfileReport

    report = profile(**TINY_JOB, steps=2, warmup=0, batch_probe=False, precision_probe=False, bandwidth="1GB/s")
    assert isinstance(report, ProfileReport)
    assert (report.model, report.micro_batch, report.accumulation, report.steps, report.warmup, report.rank) == \
        ("gpt-tiny", 2, 1, 2, 0, 0)
    assert report.step_s > 0 and report.tokens_per_s > 0
    with pytest.raises(ConfigError, match="overlap"):
        profile(**TINY_JOB, overlap=1.5)


def test_train_final_loss_equals_the_cli_metrics(trainfit_cli, tmp_path):
    from trainfit.front.train import train
    from trainfit.results import TrainSummary

    summary = train(**TINY_JOB, steps=3, run_dir=str(tmp_path / "py"), progress=False)
    done = trainfit_cli("train", *TINY_FLAGS, "--steps", "3", "--run-dir", str(tmp_path / "cli"))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert isinstance(summary, TrainSummary) and summary.steps == 3 and len(rows) == 3
    assert summary.final_loss == rows[-1]["loss"] and summary.first_loss == rows[0]["loss"]
    assert f"{summary.final_loss:.6g}" in str(summary)


def test_prepare_writes_the_bytes_of_the_text(tmp_path):
    import numpy as np

    from trainfit.front.prepare import prepare
    from trainfit.results import PrepareReport

    text = "héllo, front door\nsecond line\n"
    (tmp_path / "doc.txt").write_text(text, encoding="utf-8")
    report = prepare(data=str(tmp_path / "doc.txt"), out=str(tmp_path / "tokens"))
    raw = list(text.encode("utf-8"))
    assert isinstance(report, PrepareReport)
    assert (report.n_documents, report.n_tokens, report.tokenizer, report.vocab_size) == (1, len(raw) + 1, "byte", 257)
    ids = np.fromfile(tmp_path / "tokens" / "tokens.bin", dtype=np.dtype(report.dtype).newbyteorder("<"))
    assert ids.tolist() == raw + [256]  # the byte tokenizer: the UTF-8 bytes, then end-of-document
    with pytest.raises(ConfigError, match="--out"):
        prepare(data=str(tmp_path / "doc.txt"), out=str(tmp_path / "tokens"))  # not empty, no force


# -- end of trainfit.front.memory / profile / train / prepare --------------------------------------------------------


# -- the package's top-level names (trainfit.plan, trainfit.train, ...) ---------------------------------------------
def test_top_level_names_are_the_front_door_and_the_submodules_still_import():
    """``trainfit.plan`` / ``trainfit.train`` are both the submodule and, when called, the front-door function."""
    import importlib

    import trainfit
    import trainfit.front.memory
    import trainfit.front.plan
    import trainfit.front.train
    import trainfit.plan.search  # the planner's package still imports as a package

    # the same function, its arguments checked at the door first (issue 35, row 13: front.request.check_arguments)
    assert trainfit.estimate_memory.__wrapped__ is trainfit.front.memory.estimate_memory
    assert trainfit.plan is importlib.import_module("trainfit.plan") and trainfit.plan.search.search
    job = dict(model="gpt-tiny", global_batch=32, seq_len=64, device_memory="80GiB", device="h100", devices=8)
    via_top, direct = trainfit.plan(**job), trainfit.front.plan.plan(**job)
    assert via_top.to_dict()["plans"] == direct.to_dict()["plans"] and via_top.best == direct.best
    assert callable(importlib.import_module("trainfit.train")) and trainfit.train.__name__ == "trainfit.train"
    for name in trainfit.__all__:
        assert getattr(trainfit, name) is not None, name
