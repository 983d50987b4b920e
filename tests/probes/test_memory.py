"""Measured memory against hand calculations (tier b)."""

from pathlib import Path

import pytest
import torch

from trainfit.config import make_config
from trainfit.meters.tracker import memory_cap
from trainfit.probes.batchfit import fit_batch_scaling, fit_line
from trainfit.probes.memory import measure_memory

from .trainfit_linear_stack import D_HID, D_IN, D_OUT

N_PARAMS = D_IN * D_HID + D_HID + D_HID * D_OUT + D_OUT  # two Linear layers with bias
N_TENSORS = 4  # weights and biases


@pytest.fixture
def user_stack(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    return "trainfit_linear_stack:make"


def _cfg(model, **kw):
    base = dict(model=model, micro_batch=4, accumulation=1, grad_clip=0.0)
    return make_config({**base, **kw})


def test_linear_stack_adamw_fp32_matches_hand_count_to_the_byte(user_stack):
    r = measure_memory(_cfg(user_stack))
    assert r.n_params == N_PARAMS
    assert r.params_bytes == 4 * N_PARAMS
    assert r.grads_bytes == 4 * N_PARAMS
    # Adam: exp_avg + exp_avg_sq in fp32, plus one fp32 scalar `step` tensor per parameter tensor.
    assert r.optimizer_bytes == 2 * 4 * N_PARAMS + 4 * N_TENSORS
    assert r.master_weights_bytes == 0
    # Saved for backward at batch 4: Linear-1's input x, ReLU's output (also Linear-2's input,
    # one storage), log_softmax's output, the int64 targets and nll_loss's fp32 total weight.
    n = 4
    assert r.activations_bytes == n * D_IN * 4 + n * D_HID * 4 + n * D_OUT * 4 + n * 8 + 4
    assert r.peak_bytes == sum(r.peak_parts.values())
    assert r.peak_phase in ("forward", "backward", "optimizer")


def test_bf16_true_adds_exactly_the_fp32_master_copy(user_stack):
    fp32 = measure_memory(_cfg(user_stack))
    half = measure_memory(_cfg(user_stack, precision="bf16-true"))
    assert half.params_bytes == 2 * N_PARAMS
    assert half.master_weights_bytes == 4 * N_PARAMS
    assert half.optimizer_bytes == fp32.optimizer_bytes + 4 * N_PARAMS
    assert half.grads_bytes == 4 * N_PARAMS  # the fp32 grads of the masters are the largest
    assert any("halved" in note and "master" in note for note in half.notes)


def test_sgd_momentum_state_is_one_copy(user_stack):
    r = measure_memory(_cfg(user_stack, optimizer="sgd"))
    assert r.optimizer_bytes == 4 * N_PARAMS


def test_bf16_mixed_does_not_halve_parameters_and_says_so(tiny_gpt_overrides):
    kw = dict(model_config=tiny_gpt_overrides, seq_len=16)
    fp32 = measure_memory(_cfg("gpt-tiny", **kw))
    mixed = measure_memory(_cfg("gpt-tiny", precision="bf16-mixed", **kw))
    true = measure_memory(_cfg("gpt-tiny", precision="bf16-true", **kw))
    assert mixed.params_bytes == fp32.params_bytes == 4 * fp32.n_params
    assert true.params_bytes == 2 * fp32.n_params
    assert any("NOT halved" in n for n in mixed.notes)
    assert mixed.activations_bytes < fp32.activations_bytes  # autocast shrinks what is saved


def test_activations_grow_linearly_with_batch(tiny_gpt_overrides):
    cfg = _cfg("gpt-tiny", model_config=tiny_gpt_overrides, seq_len=16)
    batches = (1, 2, 3, 5)
    reports = [measure_memory(cfg, batch=b) for b in batches]
    acts = [r.activations_bytes for r in reports]
    _, per_sample, residual = fit_line(batches, acts)
    assert residual < 0.02, (acts, residual)
    assert per_sample > 0
    s = fit_batch_scaling(cfg, batches=(2, 5), method="measure", reports=reports)  # reuses, no new steps
    assert s.activations_per_sample_bytes == pytest.approx(per_sample, rel=0.02)
    assert s.parts_at(3)["activations"] == pytest.approx(acts[2], rel=0.02)


def test_full_checkpointing_keeps_only_block_inputs():
    L, B, T, C = 3, 2, 16, 32
    kw = dict(model_config=f"n_layer={L},d_model={C},n_head=2", seq_len=T, micro_batch=B)
    none = measure_memory(_cfg("gpt-tiny", **kw))
    full = measure_memory(_cfg("gpt-tiny", checkpointing="full", **kw))
    blocks = dict(full.top_modules)["blocks.*"]
    assert blocks == L * B * T * C * 4  # one fp32 (B, T, C) input per block, nothing else
    ratio = none.activations_bytes / full.activations_bytes
    print(f"checkpointing=full cuts activations {ratio:.1f}x ({none.activations_bytes} -> {full.activations_bytes})")
    assert ratio > 2.5


def test_memory_cap_raises_out_of_memory_during_training(tiny_gpt_overrides):
    from trainfit.engine import optimizer_step
    from trainfit.probes.memory import example_batch
    from trainfit.run import build_run

    run = build_run(_cfg("gpt-tiny", model_config=tiny_gpt_overrides, seq_len=16))
    mb = example_batch(run.task, 4)

    def step():
        return optimizer_step(model=run.model, optimizer=run.optimizer, precision=run.precision,
                              micro_batches=[mb], loss_fn=run.task.loss, count_fn=run.task.count)

    params = sum(p.numel() * 4 for p in run.model.parameters())
    with pytest.raises(torch.OutOfMemoryError, match="memory_cap"):
        with memory_cap(params + 1000, model=run.model, optimizer=run.optimizer):
            step()
    with memory_cap(50 * params, model=run.model, optimizer=run.optimizer) as tracker:
        step()
    assert params < tracker.peak_bytes < 50 * params
