"""The typed reports: to_dict is the stored JSON, from_dict reads it back, and the page renders from each kind."""

import copy
import json
from html.parser import HTMLParser

import pytest

from trainfit.report.data import load_run
from trainfit.report.html import write_report
from trainfit.results import (
    Advice,
    BatchProbe,
    MemoryReport,
    PlanReport,
    PlanRow,
    ProfileReport,
    ResultFormatError,
    VerifyReport,
)
from trainfit.vocabulary import Tolerance

from .conftest import MEMORY, MIB, PLAN, PROFILE, VERIFY

pytest.importorskip("matplotlib")

KINDS = [("memory.json", MemoryReport, MEMORY[0]), ("memory.json", MemoryReport, MEMORY[1]),
         ("profile.json", ProfileReport, PROFILE), ("plan.json", PlanReport, PLAN),
         ("verify.json", VerifyReport, VERIFY)]
IDS = ["memory-fp32", "memory-bf16-true", "profile", "plan", "verify"]


def text_of(path) -> str:
    parts: list[str] = []
    parser = HTMLParser()
    parser.handle_data = parts.append
    parser.feed(path.read_text())
    return " ".join(parts)


def by_hand() -> list:
    """One report of each kind built directly (as the probes build them), lists where tuples are meant."""
    mem = MemoryReport(
        method="estimated", model="gpt-tiny", precision="bf16-mixed", checkpointing="every:2", optimizer="adamw",
        batch=4, seq_len=32, accumulation=2, n_params=1000, params_bytes=4000, grads_bytes=4000,
        optimizer_bytes=8000, master_weights_bytes=0, activations_bytes=12000, temporaries_bytes=500,
        peak_bytes=26000, peak_phase="backward",
        peak_parts={"params": 4000, "grads": 2000, "optimizer": 8000, "activations": 11500, "temporaries": 500},
        phases={"backward": {"peak": 26000, "params": 4000, "grads": 2000, "optimizer": 8000,
                             "activations": 11500, "temporaries": 500}},
        top_modules=(("blocks.*.mlp", 6000), ("head", 100)), notes=("a note",), wall_s=0.25,
        details={"shortcut": "traced 1 and 2 of 4 blocks"})
    prof = ProfileReport(
        data_wait_frac=0.1, data_wait_s=0.01, h2d_s=0.0, forward_s=0.03, backward_s=0.05, optimizer_s=0.01,
        comm_exposed_s=0.002, rest_s=0.001, step_s=0.104, busy_frac=0.8, tokens_per_s=None, samples_per_s=77.0,
        mfu=None, hfu=None, bottleneck="compute",
        advice=[Advice(kind="batch", text="raise micro_batch from 2 to 4", figures={"micro_batch": 4,
                                                                                    "rates": (1.0, 2.0)})],
        unit="samples", batch_probe=BatchProbe(micro_batch=2, gain=0.5, rates_per_s=(10.0, 15.0), note="probed",
                                               suggested_micro_batch=4, fit="fits"),
        scaling={"strategy": "ddp", "curves": {}, "pair": (1, 2)}, device="cuda:0", world_size=2, rank=0,
        strategy="ddp", steps=5, warmup=1, trace="/tmp/trace.json", threads=4)
    row = PlanRow(precision="fp32", micro_batch=8, accumulation=1, checkpointing="none", strategy="single",
                  peak_bytes_per_device=3 * MIB, step_s=0.5, scaling_efficiency=1.0, fits=True,
                  reasons=["fits"], grad_sync="deferred", parts={"params": MIB})
    plan = PlanReport(model="gpt-tiny", global_batch=8, devices=1, device_memory_bytes=64 * MIB, basis="estimate",
                      candidates=30, excluded={"rule": 3}, notes=["a note"], plans=[row])
    ver = VerifyReport(precision="fp16-mixed", strategy="ddp", micro_batch=2, accumulation=2, world_size=2,
                       global_batch=8, grad_cosine=0.5, grad_rel_error=1.5, grad_norm_ratio=65536.0,
                       update_max_rel_error=float("inf"), skipped_steps=1, fp16_underflow_frac=0.0,
                       loss_scale=65536.0, tolerance=Tolerance(min_cosine=0.99, max_grad_rel_error=0.1,
                                                               max_update_rel_error=0.2),
                       passed=False, causes=["never unscaled"])
    return [mem, prof, plan, ver]


@pytest.mark.parametrize("report", by_hand(), ids=lambda r: type(r).__name__)
def test_round_trip_through_json(report):
    d = report.to_dict()
    back = type(report).from_dict(json.loads(json.dumps(d)))
    assert back == report
    assert back.to_dict() == d


@pytest.mark.parametrize("name, kind, doc", KINDS, ids=IDS)
def test_stored_json_reads_back_to_the_same_json(name, kind, doc):
    r = kind.from_dict(doc)
    assert r.to_dict() == doc  # every key kept, nothing added (dominant_part and lever are recomputed)
    assert kind.from_dict(r.to_dict()) == r


def test_the_configuration_is_on_the_reports():
    mem, prof, plan, ver = (kind.from_dict(doc) for _, kind, doc in KINDS[1:])
    assert (mem.precision, mem.checkpointing, mem.batch, mem.accumulation) == ("bf16-true", "full", 8, 1)
    assert (prof.strategy, prof.world_size, prof.micro_batch) == ("single", 1, 8)
    assert (prof.model, prof.precision, prof.accumulation, prof.checkpointing) == ("gpt-tiny", "bf16-mixed", 4, "none")
    assert (plan.global_batch, plan.devices) == (64, 8)
    assert [(r.strategy, r.precision, r.micro_batch, r.accumulation, r.checkpointing) for r in plan.plans] == [
        ("zero2", "bf16-mixed", 4, 2, "full"), ("ddp", "bf16-mixed", 4, 2, "full")]
    assert plan.best is plan.plans[0] and plan.plans[1].reasons == ("does not fit: 95 GiB > 80 GiB",)
    assert (ver.precision, ver.strategy, ver.micro_batch, ver.accumulation, ver.world_size) == (
        "bf16-mixed", "single", 4, 3, 1)
    assert ver.tolerance == Tolerance(min_cosine=0.9999, max_grad_rel_error=0.02, max_update_rel_error=0.05)
    assert prof.advice[0] == Advice(kind="input", text="raise loader_workers from 0 to 2; data wait is 33% of the "
                                    "step", figures={"data_wait_frac": 0.33})


@pytest.mark.parametrize("name, kind, doc", KINDS, ids=IDS)
def test_unknown_keys_are_kept_in_extra(name, kind, doc):
    r = kind.from_dict({**doc, "written_by": "trainfit 0.2", "plot": "p.png"})
    assert r.extra == {"written_by": "trainfit 0.2", "plot": "p.png"}
    assert r.to_dict() == {**doc, "written_by": "trainfit 0.2", "plot": "p.png"}


def test_missing_optional_keys_take_defaults_and_missing_required_ones_are_named():
    optional = ("tokens_per_s", "mfu", "hfu", "advice", "per_device", "parts", "fractions", "trace", "threads",
                "scaling", "peak_flops", "flops_steps")
    prof = ProfileReport.from_dict({k: v for k, v in PROFILE.items() if k not in optional})
    assert prof.advice == () and prof.mfu is None and prof.trace is None and prof.scaling == {} and prof.per_device
    assert prof.step_s == PROFILE["step_s"]
    plan = PlanReport.from_dict({k: v for k, v in PLAN.items() if k not in ("notes", "excluded")})
    assert plan.notes == () and plan.excluded == {}
    ver = VerifyReport.from_dict({k: v for k, v in VERIFY.items() if k != "causes"})
    assert ver.causes == ()
    with pytest.raises(ResultFormatError, match="missing step_s, busy_frac"):
        ProfileReport.from_dict({k: v for k, v in PROFILE.items() if k not in ("step_s", "busy_frac")})
    with pytest.raises(ResultFormatError, match=r"PlanRow: missing fits"):
        PlanReport.from_dict({**PLAN, "plans": [{k: v for k, v in PLAN["plans"][0].items() if k != "fits"}]})


@pytest.mark.parametrize("kind, doc, message", [
    (MemoryReport, {**MEMORY[0], "peak_bytes": "70MiB"}, "MemoryReport.peak_bytes: expected int"),
    (MemoryReport, {**MEMORY[0], "top_modules": [{"module": "x"}]}, "without 'activations_bytes'"),
    (MemoryReport, {**MEMORY[0], "params_bytes": -1}, "params_bytes"),
    (ProfileReport, {**PROFILE, "advice": [{"text": "no kind"}]}, "Advice: missing 'kind'"),
    (ProfileReport, {**PROFILE, "batch_probe": {"micro_batch": 8}}, "BatchProbe: missing gain"),
    (PlanReport, {**PLAN, "plans": {"rank": 1}}, "PlanReport.plans: expected a list"),
    (VerifyReport, {**VERIFY, "passed": "yes"}, "VerifyReport.passed: expected bool"),
    (VerifyReport, {**VERIFY, "tolerance": {"min_cosine": 0.9}}, "Tolerance: missing max_grad_rel_error"),
    (VerifyReport, [VERIFY], "expected a JSON object, got list"),
])
def test_what_is_not_a_report_is_refused_with_the_field_named(kind, doc, message):
    with pytest.raises(ResultFormatError, match=message):
        kind.from_dict(doc)


@pytest.mark.parametrize("name, kind, doc, heading, shown", [
    ("memory.json", MemoryReport, MEMORY, "Memory", ["bf16-true / full / batch 8", "master copy adds 12 MiB"]),
    ("profile.json", ProfileReport, PROFILE, "Step time", ["profile 1: bf16-mixed, micro-batch 8, accumulation 4, checkpointing none, single x 1", "input",
                                                           "raise loader_workers from 0 to 2"]),
    ("plan.json", PlanReport, PLAN, "Plan", ["llama-7b: global batch 64 on 8 device(s)",
                                             "zero2 halves gradient memory per rank", "step times assume 40%"]),
    ("verify.json", VerifyReport, VERIFY, "Verify", ["bf16-mixed", "0.99998", "cosine >= 0.9999"]),
], ids=["memory", "profile", "plan", "verify"])
def test_the_page_renders_from_the_stored_json_of_each_kind(tmp_path, name, kind, doc, heading, shown):
    (tmp_path / name).write_text(json.dumps(doc))
    art = load_run(tmp_path)
    typed = {"memory.json": art.memory, "profile.json": art.profile, "plan.json": art.plan,
             "verify.json": art.verify}[name]
    assert typed and all(isinstance(r, kind) for r in typed) and art.notes == []
    text = text_of(write_report(tmp_path))
    assert f"{heading}" in text
    for s in shown:
        assert s in text, s


def test_a_file_of_another_schema_is_named_in_a_note_and_left_out(run_dir):
    old = {"precision": "fp32", "bottleneck": "input", "breakdown": {"forward_s": {"median": 0.02}},
           "advice": [{"kind": "input", "text": "a foreign profile"}]}
    (run_dir / "profile.json").write_text(json.dumps(old))
    memory = copy.deepcopy(MEMORY) + [{"plans": []}]
    (run_dir / "memory.json").write_text(json.dumps(memory))
    art = load_run(run_dir)
    assert art.profile == [] and len(art.memory) == 2
    notes = [n for n in art.notes if not n.startswith("metrics.jsonl")]
    assert len(notes) == 2
    assert notes[0].startswith("memory.json entry 3: not a MemoryReport (MemoryReport: missing method")
    assert notes[1].startswith("profile.json: not a ProfileReport (ProfileReport: missing data_wait_frac")
    assert all(n.endswith("; left out") and "\n" not in n for n in notes)
    text = text_of(write_report(run_dir))
    assert "a foreign profile" not in text and "left out" in text and "master copy adds 12 MiB" in text
