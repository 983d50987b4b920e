"""The precision probe and its advice: the chosen precision measured against the others that need no more memory."""

import json

import pytest
import torch

from trainfit.cli import main
from trainfit.probes.advice import (
    PRECISION_SLOWER_THRESHOLD,
    Findings,
    advise,
    fmt_ratio,
    precision_candidates,
    precision_memory,
)
from trainfit.probes.profile import ProfileOptions, supported_precisions
from trainfit.results import ProfileReport
from trainfit.vocabulary import PRECISIONS, PrecisionName

TINY = ["--model-config", "n_layer=1,d_model=64,n_head=2", "--seq", "32", "--micro-batch", "4", "--accumulation", "1",
        "--steps", "2", "--warmup", "1", "--no-batch-probe", "--bandwidth", "1GB/s", "--json"]
BASE = dict(comm_exposed_frac=0.0, h2d_frac=0.01, loader_workers=0, device_type="cpu", world_size=1,
            strategy="single", micro_batch=4, scaling_note="scale out with ddp: 2: 1.9x", device_label="this CPU")


def _profile(capsys, *flags) -> dict:
    assert main(["profile", *TINY, *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_fp16_mixed_measured_against_bf16_mixed_on_this_cpu(capsys, one_thread):
    r = _profile(capsys, "--precision", "fp16-mixed")
    times = r["precision_probe"]
    assert set(times) == {"fp16-mixed", "bf16-mixed"}  # the one candidate with the same memory, both measured
    assert all(t > 0 for t in times.values()) and "bf16-mixed" in r["precision_probe_note"]
    ratio = times["fp16-mixed"] / times["bf16-mixed"]
    advice = [a for a in r["advice"] if a["kind"] == "precision"]
    assert bool(advice) == (ratio > PRECISION_SLOWER_THRESHOLD), (ratio, r["advice"])
    if advice:
        (a,) = advice
        assert a["suggested_precision"] == "bf16-mixed" and a["ratio"] == pytest.approx(ratio)
        for words in ("fp16-mixed steps take", fmt_ratio(ratio), "this CPU", "no fast fp16 matmul", "use bf16-mixed"):
            assert words in a["text"]
        kinds = [x["kind"] for x in r["advice"]]
        assert kinds.index("precision") < kinds.index("scale-out")
    report = ProfileReport.from_dict(r)  # the stored times round-trip
    assert report.precision_probe == pytest.approx(times) and report.to_dict() == r


def test_the_probe_is_skipped_when_asked(capsys, one_thread):
    r = _profile(capsys, "--no-precision-probe")
    assert r["precision_probe"] == {} and r["precision_probe_note"] == "not probed"
    assert not any(a["kind"] == "precision" for a in r["advice"])
    assert ProfileOptions().precision_probe is False  # the library asks for it; the CLI asks by default


def _findings(times, **kw) -> Findings:
    given = dict(data_wait_frac=0.01, batch_gain=0.4, rates=(100.0, 140.0), suggested_micro_batch=8,
                 fit_note="fits", precision="fp16-mixed", precision_times=times, **BASE)
    return Findings(**{**given, **kw})


def test_precision_advice_after_batch_before_scale_out():
    b, adv = advise(_findings({"fp16-mixed": 0.3, "bf16-mixed": 0.1}))
    assert b == "batch"
    assert [a["kind"] for a in adv] == ["batch", "precision", "scale-out"]
    p = adv[1]
    assert p["ratio"] == pytest.approx(3.0) and p["suggested_precision"] == "bf16-mixed"
    assert p["text"].startswith("fp16-mixed steps take 3.0x bf16-mixed on this CPU")
    assert "no fast fp16 matmul here; use bf16-mixed" in p["text"]
    assert adv[-1]["text"].startswith("after the fixes above")
    # with communication advice: precision still comes before it (it is part of scaling out)
    _, adv = advise(_findings({"fp16-mixed": 0.3, "bf16-mixed": 0.1}, world_size=2, comm_exposed_frac=0.3))
    assert [a["kind"] for a in adv] == ["batch", "precision", "communication", "scale-out"]
    # compute-bound with only the precision to fix: scale-out still waits for it
    _, adv = advise(_findings({"fp16-mixed": 0.3, "bf16-mixed": 0.1}, batch_gain=0.05))
    assert [a["kind"] for a in adv] == ["precision", "scale-out"] and adv[1]["text"].startswith("after")


def test_no_precision_advice_within_noise_or_for_more_memory():
    _, adv = advise(_findings({"fp16-mixed": 0.11, "bf16-mixed": 0.1}))  # ratio 1.1: noise
    assert [a["kind"] for a in adv] == ["batch", "scale-out"]
    _, adv = advise(_findings({"fp16-mixed": 0.3}))  # nothing to compare with
    assert "precision" not in [a["kind"] for a in adv]
    # fp32 is faster here but needs more activation memory than bf16-mixed: never advised
    _, adv = advise(_findings({"bf16-mixed": 1.0, "fp32": 0.1}, precision="bf16-mixed"))
    assert "precision" not in [a["kind"] for a in adv]


def test_fp32_candidates_need_no_more_memory():
    cands = precision_candidates("fp32")
    assert set(cands) == {PrecisionName.BF16_MIXED, PrecisionName.FP16_MIXED}
    fp32 = precision_memory("fp32")
    for p in PRECISIONS:
        fits = all(a <= b for a, b in zip(precision_memory(p), fp32))
        assert (p in cands) == (fits and p != PrecisionName.FP32), p
    # the master-copy precisions hold an fp32 gradient of the master while stepping: more than fp32's state
    assert precision_memory("bf16-true")[0] > fp32[0] and precision_memory("fp16-true")[0] > fp32[0]
    assert PrecisionName.FP32 not in precision_candidates("bf16-mixed")  # fp32 activations need more
    assert precision_candidates("fp16-mixed") == (PrecisionName.BF16_MIXED,)
    assert precision_candidates("fp16-true") == (PrecisionName.BF16_TRUE,)
    assert precision_candidates("fp32", supported=["fp32", "fp16-mixed"]) == (PrecisionName.FP16_MIXED,)
    assert set(supported_precisions(torch.device("cpu"))) == set(PRECISIONS)
