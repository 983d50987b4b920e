"""FLOP counting against hand calculations (matmul FLOPs = 2 x M x N x K)."""

import pytest
import torch
from torch import nn

from trainfit.levers.checkpointing import apply_checkpointing, parse_checkpoint_policy
from trainfit.meters.flops import FlopCounter, count_flops
from trainfit.presets import GPTConfig
from trainfit.tasks.builtin import gpt_loss
from trainfit.tasks.gpt import GPT


class Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x):
        return torch.relu(self.fc(x))


def mlp():
    return nn.Sequential(Blk(), nn.Linear(32, 8))


def mlp_loss(model, x):
    return model(x).sum(), x.shape[0]


B = 4
FWD = 2 * B * 16 * 32 + 2 * B * 32 * 8
# backward: both weight grads (= forward) + the input grad of the second layer only
# (the data does not require grad, so the first layer's input grad is never computed).
BWD = 2 * B * 16 * 32 + 2 * (2 * B * 32 * 8)


def counter(policy: str, build=mlp, loss=mlp_loss):
    pol = parse_checkpoint_policy(policy)

    def recompute(m):
        apply_checkpointing(m, pol, [n for n, x in m.named_modules() if isinstance(x, Blk)])

    return FlopCounter(build_model=build, loss_fn=loss, recompute=None if policy == "none" else recompute)


def test_mlp_forward_backward_by_hand():
    assert count_flops(mlp(), mlp_loss, torch.randn(B, 16)) == FWD + BWD


def test_recompute_is_in_hardware_flops_only():
    x = torch.randn(B, 16)
    plain = counter("none").step([x, x])
    assert plain.model_flops == plain.hardware_flops == 2 * (FWD + BWD)
    ckpt = counter("full").step([x, x])
    assert ckpt.counted_on == "meta"
    assert ckpt.model_flops == 2 * (FWD + BWD)
    assert ckpt.hardware_flops == 2 * (FWD + BWD + 2 * B * 16 * 32)  # the block's forward again


def test_gpt_on_meta_is_three_forwards_by_hand():
    Bg, T, d, V, L = 2, 16, 32, 64, 2
    cfg = GPTConfig(vocab_size=V, max_seq_len=T, n_layer=L, n_head=2, d_model=d)
    ids = torch.randint(0, V, (Bg, T))
    got = counter("none", build=lambda: GPT(cfg), loss=gpt_loss).step([{"input_ids": ids, "labels": ids}])
    # per block: qkv 3d^2 + proj d^2 + mlp 8d^2 = 12 d^2 MACs per token; attention QK^T and AV: 2 T d per token
    fwd = L * (24 * Bg * T * d * d + 4 * Bg * T * T * d) + 2 * Bg * T * d * V
    assert got.model_flops == 3 * fwd  # backward = 2 x forward: every input needs its grad


def test_shapes_are_cached_and_the_budget_is_kept():
    c = counter("none")
    c.max_counts = 2
    a, b, d = torch.randn(B, 16), torch.randn(2 * B, 16), torch.randn(3 * B, 16)
    assert c.step([a, a]) is not None
    assert c.step([b]) is not None
    assert c.step([a, d]) is None  # a third shape would exceed the budget
    assert c.step([b, a]).model_flops == 3 * (FWD + BWD)  # cached shapes still count


def test_model_that_cannot_run_on_meta_falls_back_to_cpu():
    def item_loss(model, x):
        out = model(x)
        scale = float(out.detach().abs().max().item()) + 1.0  # data-dependent: impossible on meta
        return out.sum() / scale, x.shape[0]

    got = counter("none", loss=item_loss).step([torch.randn(B, 16)])
    assert got.counted_on == "cpu"
    assert got.model_flops == pytest.approx(FWD + BWD)


def test_the_first_step_is_counted_even_beyond_the_budget():
    c = counter("none")
    c.max_counts = 1
    shapes = [torch.randn(k, 16) for k in (1, 2, 3)]
    assert c.step(shapes).model_flops == 6 * (FWD + BWD) // B  # 1 + 2 + 3 samples
    assert c.step([torch.randn(5, 16)]) is None
