"""Offload to host memory (levers/offload.py): what is refused, that offloaded steps equal resident ones,
and that the tracker's device/host split equals the policy's arithmetic byte for byte."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.reliability.cli_harness import check_promise, cli, snapshot
from trainfit.commands.memory import offload_lines
from trainfit.config import make_config
from trainfit.errors import ConfigError
from trainfit.levers.offload import (HostActivations, HostOptimizer, host_optimizer_bytes, plan_offload,
                                     single_device_offload)
from trainfit.plan.offload import offload_price
from trainfit.probes.estimate import trace
from trainfit.meters.tracker import memory_cap
from trainfit.probes.memory import example_batch, new_tracker, tracked_step, warm_up
from trainfit.results import MemoryReport
from trainfit.run import build_run
from trainfit.vocabulary import PARTS

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: a second intra-op thread only adds contention on a shared 2-core machine (100x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TINY = dict(model_config="n_layer=2,d_model=32", seq_len=16, micro_batch=2, accumulation=2, dataset_size=32,
            optimizer="adamw", lr=1e-2, weight_decay=0.1)


# ---- the pure core ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,strategy,why", [
    ("params", "single", "params only with strategy=zero3"),
    ("params", "ddp", "params only with strategy=zero3"),
    ("optimizer,params", "zero2", "params only with strategy=zero3"),
    ("optimizer", "zero3", "optimizer and params together"),
    ("params", "zero3", "optimizer and params together"),
    ("optimizer", "zero1", "optimizer with strategy ddp or zero2"),
])
def test_plan_refuses_what_cannot_be_done(spec, strategy, why):
    with pytest.raises(ConfigError, match=why):
        plan_offload(spec, strategy)


def test_plan_says_which_mechanism():
    single = plan_offload("optimizer,activations", "ddp")
    assert (single.host_optimizer, single.fsdp_cpu_offload, single.activations) == (True, False, True)
    zero3 = plan_offload("optimizer,params", "zero3")
    assert (zero3.host_optimizer, zero3.fsdp_cpu_offload, zero3.activations) == (False, True, False)
    assert "CPUOffloadPolicy" in zero3.describe()[0] and "again for backward" in zero3.describe()[0]
    assert plan_offload("optimizer", "zero2").fsdp_cpu_offload
    assert plan_offload("", "single").describe() == ()
    assert single_device_offload("optimizer,params,activations", "zero3") == "activations,optimizer"
    assert plan_offload(single_device_offload("optimizer,params", "zero3"), "single").host_optimizer


def test_price_is_the_hand_calculation():
    n, gib = 10**9, 2**30
    single = offload_price(parts={"optimizer", "activations"}, strategy="single", n_params=n, accumulation=4,
                           weight_bytes=2, state_bytes_per_param=8, master_bytes_per_param=4,
                           activation_bytes_per_micro_batch=gib, host_bytes_per_s=64e9)
    # optimizer: bf16 grads down + bf16 weights up once; activations: 4 micro-batches of 1 GiB down and up
    assert single.bytes_per_step == 2 * n + 2 * n + 2 * 4 * gib
    assert single.frees_device_bytes == 12 * n + gib
    assert single.seconds_per_step == pytest.approx((4 * n + 8 * gib) / 64e9)
    zero3 = offload_price(parts={"optimizer", "params"}, strategy="zero3", n_params=n, world_size=8, accumulation=2)
    shard = n // 8
    assert zero3.traffic[0].up_bytes == 4 * shard * 2 * 2  # fp32 shard gathered in forward and backward, x2
    assert zero3.traffic[0].down_bytes == 4 * shard  # one reduce-scatter per step (deferred)
    assert zero3.seconds_per_step is None and "unknown bandwidth" in zero3.reason
    zero2 = offload_price(parts={"optimizer"}, strategy="zero2", n_params=n, world_size=8, accumulation=2,
                          grad_sync="per-micro-batch", host_bytes_per_s=32e9)
    assert (zero2.traffic[0].up_bytes, zero2.traffic[0].down_bytes) == (4 * shard * 2, 4 * shard * 2)
    assert "frees" in zero2.reason and "s/step" in zero2.reason
    assert offload_price(parts=set(), strategy="ddp", n_params=n).reason == ""


# ---- numerics --------------------------------------------------------------------------------------------
def _train(steps: int = 3, **kw):
    run = build_run(make_config({**TINY, **kw}))
    mb = example_batch(run.task, 2)
    losses = [run.step([mb, mb]).loss for _ in range(steps)]
    return run, losses, {k: v.detach().float().clone() for k, v in run.model.state_dict().items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16-true", "fp16-mixed"])
def test_offloaded_optimizer_equals_resident(precision):
    _, loss_a, a = _train(precision=precision)
    run, loss_b, b = _train(precision=precision, offload="optimizer")
    assert isinstance(run.precision, HostOptimizer)
    assert loss_a == pytest.approx(loss_b, rel=1e-6, abs=0)
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7), k
    # The state was created on the host copies, never on the model's weights.
    model_params = {id(p) for p in run.model.parameters()}
    assert run.optimizer.state and not any(id(p) in model_params for p in run.optimizer.state)
    if precision == "bf16-true":  # the device keeps half weights only; the fp32 master is the host copy
        assert all(p.dtype == torch.bfloat16 for p in run.model.parameters())


def test_activation_offload_gives_the_same_gradients_and_copies_each_saved_tensor_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)

    def grads(ctx):
        model.zero_grad()
        with ctx:
            h = model[1](model[0](x))
            y = model[3](model[2](h)) + (h * h).sum(-1, keepdim=True)  # h saved by two ops
        y.square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    reference = grads(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    hooks = HostActivations(torch.device("cpu"))
    packed = []
    pack = hooks.pack_hook
    hooks.pack_hook = lambda t: packed.append(pack(t)) or packed[-1]
    offloaded = grads(hooks)
    for g, r in zip(offloaded, reference):
        assert torch.equal(g, r)
    copies = [p[1] for p in packed if isinstance(p, tuple)]
    assert copies and all(not isinstance(c, nn.Parameter) for c in copies)
    assert len({id(c) for c in copies}) < len(copies)  # h (saved twice) was copied once


# ---- device vs host bytes, against the policy's arithmetic --------------------------------------------------
def _split(**kw):
    run = build_run(make_config({**TINY, **kw}))
    mb = example_batch(run.task, 2)
    warm_up(run, [mb, mb])
    tracker = new_tracker(run)
    tracked_step(run, [mb, mb], tracker)
    return run, tracker


def _counts(run):
    params = list(run.model.parameters())
    return sum(p.numel() for p in params), len(params)


@pytest.mark.parametrize("precision,weight_bytes", [("fp32", 4), ("bf16-true", 2)])
def test_optimizer_offload_split_is_the_policy_arithmetic(precision, weight_bytes):
    run, tr = _split(precision=precision, offload="optimizer")
    n, tensors = _counts(run)
    host = host_optimizer_bytes(n_trainable=n, state_bytes_per_param=8)  # AdamW: m and v, fp32
    steps = 4 * tensors  # AdamW's step count: one fp32 scalar per parameter tensor, with its state
    assert tr.host_part_max["optimizer"] == host["optimizer"] + steps == (12 * n) + steps
    assert tr.host_part_max["grads"] == host["grads"] == 4 * n
    assert tr.host_part_max["params"] == 0 and tr.host_part_max["activations"] == 0
    assert tr.device_part_max["optimizer"] == 0  # no state and no master on the device
    assert tr.device_part_max["params"] == weight_bytes * n
    assert tr.device_part_max["grads"] == weight_bytes * n  # the device gradient, until it is copied down
    split = tr.host_split()
    assert split["device_peak_bytes"] == tr.device_peak_bytes < tr.peak_bytes


def test_activation_offload_split_is_what_autograd_saves():
    run, tr = _split(offload="activations")
    # Independent count: plain saved-tensor hooks over the same forward, distinct non-parameter tensors.
    mb = example_batch(run.task, 2)
    seen, held = {}, []

    def pack(t):
        base = t._base if t._base is not None else t
        if not isinstance(base, nn.Parameter):
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            seen[key] = t.numel() * t.element_size()
            held.append(t)  # alive until counted: no address reused
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run.task.loss(run.model, mb)
    assert tr.host_part_max["activations"] == sum(seen.values())
    assert tr.device_part_max["activations"] == 0
    assert tr.host_part_max["optimizer"] == tr.host_part_max["params"] == tr.host_part_max["grads"] == 0
    assert tr.device_part_max["optimizer"] == tr.part_max["optimizer"]  # the optimizer stays on the device


@pytest.mark.parametrize("offload,precision", [("optimizer,activations", "fp32"), ("optimizer", "bf16-true")])
def test_fake_tensor_trace_sees_the_measured_split(offload, precision):
    _, measured = _split(offload=offload, precision=precision)
    _, estimated, _, _ = trace(make_config({**TINY, "offload": offload, "precision": precision}))
    assert estimated.host_split() == measured.host_split() != {}


def test_memory_cap_counts_device_bytes_only():
    """--memory-cap stands in for the device's memory: what offload moved to the host no longer fills it."""
    resident, tr_resident = _split()
    offloaded, tr_offloaded = _split(offload="optimizer,activations")
    assert tr_offloaded.device_peak_bytes < tr_resident.peak_bytes
    cap = (tr_offloaded.device_peak_bytes + tr_resident.peak_bytes) // 2
    for run, fits in ((offloaded, True), (resident, False)):
        mb = example_batch(run.task, 2)
        try:
            with memory_cap(cap, model=run.model, optimizer=run.optimizer, optimizer_params=run.optimizer_params()):
                run.step([mb, mb])
            assert fits, "the resident run should exceed the cap"
        except torch.OutOfMemoryError:
            assert not fits, "the offloaded run's device bytes are below the cap"


def test_no_offload_reports_no_split():
    run, tr = _split()
    assert tr.host_split() == {} and tr.device_peak_bytes == 0


def test_memory_table_shows_device_and_host():
    run, tr = _split(offload="optimizer")
    zeros = dict.fromkeys(PARTS, 0)
    report = MemoryReport(method="measured", model="gpt-tiny", precision="fp32", checkpointing="none",
                          optimizer="adamw", batch=2, seq_len=16, accumulation=2, n_params=1,
                          params_bytes=0, grads_bytes=0, optimizer_bytes=0, master_weights_bytes=0,
                          activations_bytes=0, temporaries_bytes=0, peak_bytes=tr.peak_bytes, peak_phase="forward",
                          peak_parts=zeros, phases={}, top_modules=(), **tr.host_split())
    assert MemoryReport.from_dict(report.to_dict()) == report
    text = "\n".join(offload_lines(report))
    assert "on the device" in text and "in host memory" in text and "device peak" in text


@pytest.mark.parametrize("args", [
    ["--offload", "params"],
    ["--offload", "optimizer", "--strategy", "zero1"],
    ["--offload", "gpu"],
])
def test_cli_refuses_bad_offload_with_one_line(tmp_path, args):
    before = snapshot(tmp_path)
    r = cli(["train", "--model-config", "n_layer=1,d_model=16", "--steps", "1", "--run-dir",
             str(tmp_path / "run"), *args], cwd=tmp_path)
    assert r.rc == 2
    check_promise(r, tmp_path, before)
