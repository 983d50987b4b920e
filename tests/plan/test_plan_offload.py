"""Offload as a dimension of the plan: the settings each strategy runs (the lever's rules), its price (a hand
calculation), its device bytes (the tracker), and a plan that fits only with it, run under its budget."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest

from trainfit.cli import main
from trainfit.config import load_toml, make_config
from trainfit.errors import ConfigError
from trainfit.plan.cost import Basis, Candidate, Links, memory, step_time
from trainfit.plan.offload import offload_choices
from trainfit.plan.rules import Context
from trainfit.plan.search import SearchSpace, search
from trainfit.vocabulary import STRATEGIES

TINY = "n_layer=2,d_model=32,n_head=2"


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_planner_offers_what_the_lever_runs(strategy):
    from trainfit.levers.offload import plan_offload

    for k in range(4):
        for parts in itertools.combinations(("activations", "optimizer", "params"), k):
            spec = ",".join(parts)
            try:
                plan_offload(spec, strategy)
                runs = True
            except ConfigError:
                runs = False
            assert runs == (spec in offload_choices(strategy)), (strategy, spec)


def _basis(n: int = 1000, **kw) -> Basis:
    base = dict(precision="fp32", checkpointing="none", n_params=n, n_blocks=4, params_bytes=4.0 * n,
                grads_bytes=4.0 * n, grads_at_peak_bytes=4.0 * n, optimizer_bytes=8.0 * n, compute_bytes_per_param=4.0,
                act_fixed_bytes=100.0, act_per_sample_bytes=1000.0, temp_fixed_bytes=0.0, temp_per_sample_bytes=50.0,
                step_temp_bytes=0.0, model_flops_per_sample=6e6, hardware_flops_per_sample=6e6,
                grad_comm_bytes=4.0 * n, param_comm_bytes=4.0 * n, source="test")
    base.update(kw)
    return Basis(**base)


def test_offload_seconds_are_the_hand_calculation():
    n, bw = 1000, 1e6
    links = Links(flops_per_s=1e9, bandwidth_bytes_per_s=1e9, host_bytes_per_s=bw)

    def off_s(**kw) -> float:
        c = Candidate(**{**dict(precision="fp32", micro_batch=2, accumulation=1, checkpointing="none",
                                strategy="single", grad_sync="deferred", n=1), **kw})
        eager = step_time(_basis(n), dataclasses.replace(c, offload=""), links).step_s
        t = step_time(_basis(n), c, links, offloaded_activation_bytes=memory(_basis(n), c).offloaded_activation_bytes)
        assert t.step_s == pytest.approx(eager + t.offload_s)
        return t.offload_s

    # single, fp32: gradients down (4 bytes each), weights up (4 bytes each), once per step
    assert off_s(offload="optimizer", accumulation=3) == pytest.approx(8 * n / bw)
    # bf16-true: half gradients down, half weights up (the fp32 master is the host copy)
    assert off_s(offload="optimizer", precision="bf16-true") == pytest.approx(4 * n / bw)
    # activations: each micro-batch's saved bytes (100 + 2 x 1000) down in forward and up in backward
    assert off_s(offload="activations", accumulation=2) == pytest.approx(2 * 2 * 2100 / bw)
    # zero3 on 4 ranks, accumulation 2, deferred: the fp32 shard (ceil(n / 4)) down once (one reduce-scatter),
    # up twice per micro-batch (gathered for forward and again for backward)
    shard = math.ceil(n / 4)
    assert off_s(offload="optimizer,params", strategy="zero3", n=4, accumulation=2) == pytest.approx(
        (4 * shard + 4 * shard * 2 * 2) / bw)


def test_unpriced_offload_is_excluded_and_a_priced_one_is_chosen_only_when_it_must():
    b = _basis(10_000)
    ctx = Context(devices=1, dtypes=("fp32",))
    space = SearchSpace(global_batch=4, devices=1, memory_bytes=int(16 * 10_000 / 0.9), precisions=("fp32",),
                        checkpointings=("none",), strategies=("single",), offloads=("", "optimizer"))
    no_link = Links(flops_per_s=1e9, bandwidth_bytes_per_s=1e9)
    r = search(space, ctx=ctx, basis=lambda p, ck: b, links=lambda p, ck: no_link)
    assert all(not e.offload for e in r.entries) and any("host link" in k for k in r.excluded)
    assert r.best is None  # params + grads + optimizer = 16 bytes x n: no room for activations
    linked = dataclasses.replace(no_link, host_bytes_per_s=1e9)
    r = search(space, ctx=ctx, basis=lambda p, ck: b, links=lambda p, ck: linked)
    assert r.best is not None and r.best.offload == "optimizer" and "offload optimizer: frees" in r.best.reasons[0]
    roomy = dataclasses.replace(space, memory_bytes=10**9)  # everything fits: offload's copies only cost time
    r = search(roomy, ctx=ctx, basis=lambda p, ck: b, links=lambda p, ck: linked)
    assert r.best.offload == "" and r.best.step_s < min(e.step_s for e in r.entries if e.offload)


def test_planner_device_bytes_follow_the_tracker():
    """fp32 without checkpointing (where the plan searches activation offload): the predicted device peak within
    4% of the tracker's for each offload setting; the optimizer's offload in another precision and policy frees
    exactly what the tracker sees freed."""
    from trainfit.probes.calibrate import report_basis
    from trainfit.probes.memory import measure_memory

    base = make_config({"model_config": TINY, "seq_len": 32})
    for precision, ckpt, offloads, windows in (("fp32", "none", ("optimizer", "activations", "activations,optimizer"),
                                                ((3, 1), (4, 2))),
                                               ("bf16-mixed", "every:2", ("optimizer",), ((4, 2),))):
        b = report_basis(base, precision, ckpt, source="measure")
        for off, (mb, acc) in itertools.product(offloads, windows):
            c = Candidate(precision=precision, micro_batch=mb, accumulation=acc, checkpointing=ckpt, strategy="single",
                          grad_sync="deferred", n=1, offload=off)
            cfg = make_config({"precision": precision, "checkpointing": ckpt, "micro_batch": mb, "accumulation": acc,
                               "offload": off}, base=base)
            measured = measure_memory(cfg).device_peak_bytes
            assert memory(b, c).peak_bytes == pytest.approx(measured, rel=0.04), (precision, ckpt, off, mb, acc)
            if off == "optimizer":
                resident = measure_memory(dataclasses.replace(cfg, offload="")).peak_bytes
                freed = memory(b, dataclasses.replace(c, offload="")).peak_bytes - memory(b, c).peak_bytes
                assert freed == pytest.approx(resident - measured, rel=1e-6), (precision, ckpt, mb, acc)


def test_a_plan_that_fits_only_with_offload_runs_within_its_budget(tmp_path, capsys):
    from trainfit.probes.memory import measure_memory

    job = {"model_config": TINY, "seq_len": 32, "micro_batch": 1, "accumulation": 2}
    resident = measure_memory(make_config(job)).peak_bytes
    offloaded = measure_memory(make_config({**job, "offload": "optimizer"})).device_peak_bytes
    assert offloaded < resident
    device = int((resident + offloaded) / 2 / 0.9)  # budget (10% headroom) between the two: only offload fits
    plan = tmp_path / "p.toml"
    args = ["plan", "--model-config", TINY, "--seq", "32", "--global-batch", "2", "--device", "cpu", "--calibrate",
            "--device-memory", str(device), "--precisions", "fp32", "--checkpointings", "none", "--strategies",
            "single", "--json", "--write", str(plan)]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["plans"][0]
    assert best["offload"] and best["offload_s"] > 0, best
    assert any(n.startswith("offload: searched") and "measured on this CPU" in n for n in out["notes"])
    cfg = make_config(load_toml(plan))
    assert cfg.offload == best["offload"] and cfg.micro_batch * cfg.accumulation == 2
    assert measure_memory(cfg).device_peak_bytes <= 0.9 * device
    assert main([a if a != str(plan) else str(tmp_path / "q.toml") for a in args] + ["--offloads", "none"]) == 2
    assert "nothing fits" in capsys.readouterr().err
