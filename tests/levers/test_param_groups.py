"""The standard optimizer groups: weight decay on weight matrices only -- checked against plain torch AdamW
with groups written out by hand, on a toy model with a tied head, GPT, GPT-2 (transformers) and fp32 masters."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from trainfit.config import RunConfig
from trainfit.levers.param_groups import param_groups, split
from trainfit.levers.precision import make_precision
from trainfit.run import build_run, make_optimizer


class Toy(nn.Module):
    """Embedding with a tied head, a norm, a linear layer with bias, a conv: every kind of parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.norm = nn.LayerNorm(4)
        self.lin = nn.Linear(4, 4)
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter, listed once, under "emb.weight"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        x = self.lin(self.norm(self.emb(ids)))
        return self.head(self.conv(x.transpose(1, 2)).transpose(1, 2))


def _hand_groups(m: Toy, wd: float) -> list[dict]:
    """Written out by hand: the matrices decay; biases, norm and the (tied) embedding do not."""
    return [{"params": [m.lin.weight, m.conv.weight], "weight_decay": wd},
            {"params": [m.emb.weight, m.norm.weight, m.norm.bias, m.lin.bias, m.conv.bias], "weight_decay": 0.0}]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    torch.manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(0, 11, (2, 5))
        model(ids).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_toy_model_steps_like_plain_adamw_with_hand_made_groups():
    torch.manual_seed(0)
    ours = Toy()
    ref = copy.deepcopy(ours)  # deepcopy keeps the tie
    wd, lr = 0.5, 0.05  # a large decay, so a wrongly decayed bias or embedding moves visibly
    cfg = RunConfig(weight_decay=wd, lr=lr)
    opt = make_optimizer(cfg.section("schedule"), [p for p in ours.parameters() if p.requires_grad], model=ours)
    _train(ours, opt)
    _train(ref, torch.optim.AdamW(_hand_groups(ref, wd), lr=lr))
    ref_sd = ref.state_dict()
    assert all(torch.equal(v, ref_sd[k]) for k, v in ours.state_dict().items())
    # the control: one group decaying everything ends elsewhere (the comparison above can fail)
    torch.manual_seed(0)
    control = Toy()
    _train(control, torch.optim.AdamW(control.parameters(), lr=lr, weight_decay=wd))
    assert not torch.equal(control.norm.bias, ref.norm.bias) and not torch.equal(control.emb.weight, ref.emb.weight)


def test_split_by_name_and_frozen_params_get_no_group():
    m = Toy()
    assert split(m).decay == ("lin.weight", "conv.weight")
    assert split(m).no_decay == ("emb.weight", "norm.weight", "norm.bias", "lin.bias", "conv.bias")
    m.lin.bias.requires_grad_(False)
    m.conv.weight.requires_grad_(False)
    groups = param_groups(m, [p for p in m.parameters() if p.requires_grad], 0.1)
    ids = [[id(p) for p in g["params"]] for g in groups]
    assert ids == [[id(m.lin.weight)], [id(m.emb.weight), id(m.norm.weight), id(m.norm.bias), id(m.conv.bias)]]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]


def test_no_decay_keeps_one_group():
    m = Toy()
    params = list(m.parameters())
    groups = param_groups(m, params, 0.0)
    assert len(groups) == 1 and [id(p) for p in groups[0]["params"]] == [id(p) for p in params]


def test_fp32_masters_are_grouped_by_their_model_parameter():
    """bf16-true: the optimizer updates fp32 master copies; each lands in the group of its model parameter."""
    m = Toy()
    prec = make_precision("bf16-true")
    prec.prepare(m)
    masters = prec.optimizer_params(m)
    groups = param_groups(m, masters, 0.1)
    decayed = groups[0]["params"]
    assert [t.dtype for t in decayed] == [torch.float32] * 2 and [t.shape for t in decayed] == [(4, 4), (4, 4, 3)]
    assert all(torch.equal(t.to(torch.bfloat16), w) for t, w in zip(decayed, [m.lin.weight, m.conv.weight]))
    assert {id(t) for g in groups for t in g["params"]} == {id(t) for t in masters}


def test_gpt_run_groups_by_name():
    run = build_run(RunConfig(model_config="n_layer=1,d_model=32,n_head=2", seq_len=16, weight_decay=0.1,
                              dataset_size=64))
    s = split(run.model)
    assert s.decay == ("blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.mlp.fc.weight",
                       "blocks.0.mlp.proj.weight", "head.weight")
    assert "tok_emb.weight" in s.no_decay and "pos_emb.weight" in s.no_decay
    summary = run.param_groups_summary()
    assert [g["weight_decay"] for g in summary] == [0.1, 0.0]
    assert [g["tensors"] for g in summary] == [5, 12]
    assert sum(g["elements"] for g in summary) == sum(p.numel() for p in run.model.parameters())
    # weight_decay 0 (the default): one group, as before
    assert len(build_run(RunConfig(model_config="n_layer=1,d_model=32,n_head=2", seq_len=16,
                                   dataset_size=64)).optimizer.param_groups) == 1


def test_gpt2_tied_head_is_not_decayed():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    m = transformers.GPT2LMHeadModel(cfg)
    assert m.lm_head.weight is m.transformer.wte.weight  # tied (the default)
    s = split(m)
    assert "lm_head.weight" not in s.decay + s.no_decay  # one Parameter, listed once, as the embedding
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= set(s.no_decay)
    assert s.decay == ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
                       "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight")
