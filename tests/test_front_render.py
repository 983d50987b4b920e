"""The reports render in a terminal (``str``: a plain-text table) and in a notebook (``_repr_html_``: a small HTML
table, every text escaped), generic over each report's fields (issue 29 item 1)."""

from __future__ import annotations

import dataclasses
import html
import re

import pytest

from trainfit.results import (
    Advice,
    BatchProbe,
    MemoryReport,
    PlanReport,
    PlanRow,
    ProfileReport,
    TrainSummary,
    VerifyReport,
)
from trainfit.vocabulary import Tolerance

EVIL = "gpt<script>alert(1)</script>&co"


def _profile() -> ProfileReport:
    return ProfileReport(data_wait_frac=0.125, data_wait_s=0.0025, h2d_s=0.0, forward_s=0.0075, backward_s=0.0125,
                         optimizer_s=0.0025, comm_exposed_s=0.0, rest_s=0.001, step_s=0.02, busy_frac=0.875,
                         tokens_per_s=51200.0, samples_per_s=800.0, bottleneck="compute", unit="tokens",
                         advice=(Advice(kind="batch", text="raise --micro-batch to 4 <x>"),),
                         batch_probe=BatchProbe(micro_batch=2, gain=None, rates_per_s=None, note="not probed"),
                         device="cpu", world_size=1, rank=0, strategy="single", steps=3, warmup=1, model=EVIL)


def _plan() -> PlanReport:
    row = PlanRow(precision="bf16-mixed", micro_batch=4, accumulation=8, checkpointing="full", strategy="zero3",
                  peak_bytes_per_device=3 * 2**30, step_s=1.5, scaling_efficiency=0.9, fits=True,
                  reasons=("fastest <fits>",), grad_sync="deferred")
    return PlanReport(model=EVIL, global_batch=256, devices=8, device_memory_bytes=80 * 2**30, basis="analytic",
                      candidates=12, plans=(row,))


def _verify() -> VerifyReport:
    return VerifyReport(precision="bf16-mixed", strategy="single", micro_batch=2, accumulation=4, world_size=1,
                        global_batch=8, grad_cosine=0.999987, grad_rel_error=0.00123, grad_norm_ratio=1.0,
                        update_max_rel_error=0.0005, skipped_steps=0, fp16_underflow_frac=0.0, loss_scale=1.0,
                        tolerance=Tolerance(min_cosine=0.999, max_grad_rel_error=0.05, max_update_rel_error=0.05),
                        passed=True, causes=("a <cause>",))


def _summary() -> TrainSummary:
    return TrainSummary(steps=3, final_loss=5.54404803, first_loss=5.5589, skipped_steps=0, items_per_s=421.5,
                        effective_batch=8, unit="tokens", run_dir="runs/<r>", wall_s=0.53)


def _no_raw_tags(page: str) -> bool:
    """Only the table's own tags are raw: every '<' opens one of them."""
    return all(m in ("div", "/div", "b", "/b", "table", "/table", "tr", "/tr", "th", "/th", "td", "/td", "p", "/p")
               for m in re.findall(r"<(/?\w+)", page))


@pytest.mark.parametrize("make, numbers", [
    (_profile, ["0.02", "51200", "compute", "raise --micro-batch to 4 <x>"]),
    (_plan, ["3 GiB (3,221,225,472 B)", "80 GiB (85,899,345,920 B)", "bf16-mixed", "zero3", "256"]),
    (_verify, ["0.999987", "0.00123", "True", "a <cause>"]),
    (_summary, ["5.54405", "5.5589", "421.5", "runs/<r>"]),
])
def test_each_report_renders_as_text_and_escaped_html(make, numbers):
    report = make()
    text, page = str(report), report._repr_html_()
    assert text.splitlines()[0].startswith(type(report).__name__)
    for n in numbers:
        assert n in text, (n, text)
        assert html.escape(n) in page, (n, page)
    assert _no_raw_tags(page) and "<script>" not in page
    if getattr(report, "model", ""):
        assert html.escape(EVIL) in page and EVIL in text


def test_a_real_memory_report_renders_its_key_numbers():
    from trainfit.front.memory import estimate_memory

    report = estimate_memory(model="gpt-tiny", model_config="n_layer=1,d_model=16,n_head=2", seq_len=8,
                             micro_batch=1, accumulation=1)
    report = dataclasses.replace(report, model=EVIL)
    assert isinstance(report, MemoryReport)
    text, page = str(report), report._repr_html_()
    for key in ("peak_bytes", "params_bytes", "activations_bytes", "activations_per_sample_bytes"):
        value = report.extra[key] if key in report.extra else getattr(report, key)
        assert f"{value:,} B" in text and key in page
    assert "<script>" not in page and html.escape(EVIL) in page and _no_raw_tags(page)


def test_train_summary_has_the_fields_of_the_loop_summary():
    """The loop returns the front door's typed summary itself: one class, so the fields cannot drift apart."""
    from trainfit.train import Summary

    assert Summary is TrainSummary
    s = _summary()
    assert TrainSummary.from_dict(s.to_dict()) == s and s.to_dict()["tokens_per_s"] == 421.5
