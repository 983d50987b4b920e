"""CPU ``--calibrate`` in bounded time (issue 30, item 5): a precision that cannot rank first is priced from its
matmul rate, not stepped; a pair whose steps take long is priced from its precision's first fit; each point stops
repeating at its budget; progress goes to the ``trainfit.plan`` logger."""

from __future__ import annotations

import dataclasses
import logging

import pytest

import trainfit.probes.calibrate as calibrate
from trainfit.config import make_config
from trainfit.meters.devices import device_row
from trainfit.plan.basis import analytic_basis
from trainfit.plan.cost import Links
from trainfit.plan.shapes import TransformerShape
from trainfit.probes.calibrate import calibrated_links, measure_points

TINY = {"model": "gpt-tiny", "model_config": "n_layer=1,d_model=32,n_head=2", "seq_len": 16}
SHAPE = TransformerShape(family="gpt", vocab_size=256, n_layer=1, d_model=32, n_head=2, n_kv_head=2, d_ff=128,
                         max_seq_len=16)


def _basis(p, ck):
    return analytic_basis(SHAPE, precision=p, checkpointing=ck, seq_len=16)


def _plain(rates: dict):
    """Links at a given FLOP rate per precision (what ``links_provider`` would price from ``calibrate_cpu``)."""
    return lambda p, ck="none": Links(flops_per_s=rates[p], bandwidth_bytes_per_s=1.0)


def _links(rates: dict, **kw):
    """calibrated_links of the tiny model with each precision's matmul priced at ``rates`` (no timing)."""
    return calibrated_links(make_config(TINY), _plain(rates), _basis, reps=1, precisions=tuple(rates),
                            price=rates.__getitem__, **kw)


class _Counted:
    """``measure_points`` that records which pairs were stepped (and steps them for real)."""

    def __init__(self, monkeypatch):
        self.pairs: list[tuple[str, str, tuple]] = []
        real = calibrate.measure_points

        def spy(cfg, points, **kw):
            p, ck = kw["label"].split("/")  # the pair as calibrated_links names it
            self.pairs.append((p, ck, tuple(points)))
            return real(cfg, points, **kw)

        monkeypatch.setattr(calibrate, "measure_points", spy)


def test_measure_points_stops_each_point_at_its_budget():
    """reps=4 with no budget left after a step: one measured step per point (after its warm-up); a large budget:
    all four (the clock's calls count the steps: one before the warm-up, two around each measured step)."""
    cfg = make_config({**TINY, "precision": "fp32", "micro_batch": 2, "accumulation": 1})
    calls = []

    def clock():
        calls.append(1)
        return float(len(calls))  # a measured step "takes" one tick

    out = measure_points(cfg, ((2, 1), (4, 1)), reps=4, clock=clock, budget_s=0.0)
    assert len(out) == 2 and len(calls) == 2 * (1 + 2)  # per point: the warm-up and one measured step
    calls.clear()
    measure_points(cfg, ((2, 1), (4, 1)), reps=4, clock=clock, budget_s=1e9)
    assert len(calls) == 2 * (1 + 2 * 4)
    assert out == [1.0, 1.0]  # the fake clock's step: the fastest (and only) measured step of each point


def test_a_precision_that_cannot_rank_first_is_priced_not_stepped(monkeypatch, caplog):
    """bf16-mixed's matmuls priced absurdly slow: its FLOPs at that rate exceed fp32's measured per-sample cost
    (hand bound below), so it is never stepped; it is priced at that rate with fp32's fixed costs, and one note
    names it and its rate."""
    counted = _Counted(monkeypatch)
    slow = 1e3  # FLOP/s
    notes: list[str] = []
    with caplog.at_level(logging.INFO, logger="trainfit.plan"):
        links = _links({"fp32": 1e12, "bf16-mixed": slow}, notes=notes)
        bf = links("bf16-mixed", "none")
        bf_full = links("bf16-mixed", "full")
    ref = links("fp32", "none")
    assert {p for p, _, _ in counted.pairs} == {"fp32"}  # the reference only (full: its own pair, or priced)
    lower = _basis("bf16-mixed", "none").hardware_flops_per_sample / slow
    upper = (_basis("fp32", "none").hardware_flops_per_sample / ref.flops_per_s + ref.overhead_per_micro_batch_s
             + ref.per_step_s)
    assert lower > upper  # the hand bound the decision rests on
    assert bf.flops_per_s == slow and bf_full.flops_per_s == slow  # priced at its bound
    assert (bf.overhead_per_micro_batch_s, bf.per_step_s) == (ref.overhead_per_micro_batch_s, ref.per_step_s)
    skipped = [n for n in notes if "bf16-mixed not stepped" in n]
    assert len(skipped) == 1 and "1e-06 GFLOP/s" in skipped[0]  # once per precision, with its measured rate
    assert links.notes is notes
    said = [r.getMessage() for r in caplog.records if r.name == "trainfit.plan"]
    assert any("calibrating fp32/none: micro-batch 4 x accumulation 1" in m for m in said)
    assert any("bf16-mixed not stepped" in m for m in said)


def test_a_precision_that_could_rank_first_is_stepped(monkeypatch):
    """Both priced at the same rate: bf16-mixed could be as fast as fp32, so it is stepped and fitted itself."""
    counted = _Counted(monkeypatch)
    links = _links({"fp32": 1e12, "bf16-mixed": 1e12})
    bf = links("bf16-mixed", "none")
    assert [(p, ck) for p, ck, _ in counted.pairs] == [("fp32", "none"), ("bf16-mixed", "none")]
    assert bf.flops_per_s != 1e12  # fitted to its own steps, not the priced rate
    assert links.notes == []


def test_a_precision_whose_steps_would_overrun_the_budget_is_priced(monkeypatch):
    """pair_budget_s=0: bf16-mixed could rank first but stepping it would take longer than the budget, so it is
    priced (the note says why), and fp32's other checkpointing is priced from fp32/none's fit."""
    counted = _Counted(monkeypatch)
    links = _links({"fp32": 1e12, "bf16-mixed": 1e12}, pair_budget_s=0.0)
    links("bf16-mixed", "none")
    assert [(p, ck) for p, ck, _ in counted.pairs] == [("fp32", "none")]
    assert any("bf16-mixed not stepped" in n and "over the 0 s budget per pair" in n for n in links.notes)


def test_an_expensive_pair_prices_its_other_checkpointings_from_the_first_fit(monkeypatch):
    """pair_budget_s=0: the first pair's steps are over budget, so checkpointing full is priced at fp32/none's fitted
    FLOP rate and fixed costs (its recompute FLOPs from the basis), not stepped; a large budget steps it."""
    counted = _Counted(monkeypatch)
    links = _links({"fp32": 1e12}, pair_budget_s=0.0)
    none, full = links("fp32", "none"), links("fp32", "full")
    assert [(p, ck) for p, ck, _ in counted.pairs] == [("fp32", "none")]
    assert full.flops_per_s == none.flops_per_s
    assert (full.overhead_per_micro_batch_s, full.per_step_s) == (none.overhead_per_micro_batch_s, none.per_step_s)
    assert any("fp32 with checkpointing full priced at fp32/none's fitted rate" in n for n in links.notes)
    counted.pairs.clear()
    links = _links({"fp32": 1e12}, pair_budget_s=1e9)
    links("fp32", "none"), links("fp32", "full")
    assert [(p, ck) for p, ck, _ in counted.pairs] == [("fp32", "none"), ("fp32", "full")]


def test_a_precision_cheap_to_step_is_stepped_even_if_it_cannot_rank_first(monkeypatch):
    """step_anyway_s above its (huge) calibration cost: bf16-mixed is stepped despite its bound, so its rows are
    measured, as a small model's accuracy benchmark wants."""
    counted = _Counted(monkeypatch)
    links = _links({"fp32": 1e12, "bf16-mixed": 1e3}, step_anyway_s=1e12, pair_budget_s=1e12)
    links("bf16-mixed", "none")
    assert [(p, ck) for p, ck, _ in counted.pairs] == [("fp32", "none"), ("bf16-mixed", "none")]
    assert links.notes == []


def test_screen_off_steps_every_precision(monkeypatch):
    """``screen=False`` (the accuracy benchmarks' full measurement): every pair asked for is stepped."""
    counted = _Counted(monkeypatch)
    links = _links({"fp32": 1e12, "bf16-mixed": 1e3}, screen=False)
    links("bf16-mixed", "none")
    assert [(p, ck) for p, ck, _ in counted.pairs] == [("bf16-mixed", "none")]


def test_price_matmul_is_a_linear_layer_as_the_step_runs_it():
    """The priced rate against a hand count: F.linear of the priced shape timed here, in fp32 and under bf16
    autocast, within the machine's spread of price_matmul's own timing (a factor of 3 on a shared machine)."""
    import time

    import torch
    import torch.nn.functional as F

    t, k, n = calibrate.PRICE_SHAPE
    x, w = torch.randn(t, k), torch.randn(n, k)
    for p, ctx in (("fp32", None), ("bf16-mixed", torch.bfloat16)):
        with torch.autocast("cpu", dtype=ctx) if ctx else torch.no_grad():
            F.linear(x, w)
            best = min((lambda t0: (F.linear(x, w), time.perf_counter() - t0)[1])(time.perf_counter())
                       for _ in range(5))
        hand = 2 * t * k * n / best
        assert hand / 3 < calibrate.price_matmul(p) < hand * 3, p


def test_the_old_call_still_works():
    """The call site's signature (base, plain, basis) with the CPU row's own links: a fitted fp32 pair."""
    from trainfit.probes.fastbasis import links_provider

    plain = links_provider(device_row("cpu"), nodes=1, devices=1, intra=None, inter=None)
    lk = calibrated_links(make_config(TINY), plain, _basis)("fp32", "none")  # prices every precision's matmul
    assert isinstance(lk, Links) and lk.flops_per_s > 0
    assert dataclasses.replace(lk) == lk


@pytest.mark.parametrize("bad", ["mean"])
def test_measure_step_s_refuses_an_unknown_statistic(bad):
    with pytest.raises(ValueError, match="statistic"):
        calibrate.measure_step_s(make_config({**TINY, "precision": "fp32"}), statistic=bad)
