"""verify --framework: each tool's own accumulation on uneven micro-batches, against gradients computed here.

The references are plain PyTorch written in this file: the big-batch gradient is one backward of
``sum(per-token CE) / all tokens`` over every row, unpadded, one row at a time; the mean of means is
``mean over micro-batches of (CE sum / that micro-batch's tokens)``. Counts are 30/12/5/1 loss tokens.
"""

from __future__ import annotations

import json
import sys

import torch
from tests.reliability.cli_harness import check_promise, cli, snapshot
from torch import nn
from torch.nn import functional as F

from trainfit.config import RunConfig
from trainfit.integrations.frameworks import (
    Window,
    step_accelerate,
    step_hf_trainer,
    step_lightning,
    verify_framework,
)
from trainfit.integrations.hf_window import hf_model, hf_rows
from trainfit.probes.verify import flat, rel_error
from trainfit.tasks.base import GenericTask
from trainfit.tasks.synthetic import collate_tokens

V = 17
COUNTS = (30, 12, 5, 1)  # loss tokens per micro-batch: clearly uneven
TINY_GPT = ["--model-config", "n_layer=1,d_model=32,n_head=2", "--seq-len", "32", "--micro-batch", "4"]
TINY_LLAMA = ("num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,"
              "num_key_value_heads=2,vocab_size=64")


class Bigram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.head = nn.Linear(8, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))  # (B, T, V)


def _build() -> nn.Module:
    torch.manual_seed(3)
    return Bigram()


def _loss(model, b):
    logits = model(b["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100, reduction="sum"), \
        int((b["labels"] != -100).sum())


def _window() -> tuple[Window, list[list[dict]]]:
    g = torch.Generator().manual_seed(0)
    groups = []
    for n_tokens in COUNTS:  # two rows per micro-batch, lengths summing to n_tokens
        lengths = [n_tokens - n_tokens // 3, n_tokens // 3] if n_tokens > 1 else [1]
        rows = []
        for n in lengths:
            seq = torch.randint(1, V, (n + 1,), generator=g)
            rows.append({"input_ids": seq[:-1], "labels": seq[1:]})
        groups.append(rows)
    task = GenericTask(name="bigram", unit="tokens", build_model=_build, dataset=lambda: None, collate=collate_tokens,
                       count=lambda b: int((b["labels"] != -100).sum()), loss=_loss)
    mbs = [collate_tokens(rows) for rows in groups]
    return Window(micro_batches=mbs, samples=groups, task=task, counts=list(COUNTS)), groups


def _hand_grads(groups, *, mean_of_means: bool) -> torch.Tensor:
    return _grads_of(_build(), groups, mean_of_means, lambda m, ids: m(ids))


def _grads_of(model, groups, mean_of_means: bool, logits_of) -> torch.Tensor:
    """Plain PyTorch, one unpadded row at a time: CE sum / all tokens, or / the row's micro-batch tokens / K."""
    total = sum(len(r["labels"]) for rows in groups for r in rows)
    model.zero_grad()
    for rows in groups:
        n_mb = sum(len(r["labels"]) for r in rows)
        for r in rows:
            ce = F.cross_entropy(logits_of(model, r["input_ids"][None])[0], r["labels"], reduction="sum")
            (ce / n_mb / len(groups) if mean_of_means else ce / total).backward()
    return torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])


def test_accelerate_default_is_mean_of_means_and_token_weighted_is_exact():
    w, groups = _window()
    ref = _hand_grads(groups, mean_of_means=False)
    mom = _hand_grads(groups, mean_of_means=True)
    expected = rel_error(mom, ref)
    assert expected > 0.1  # the uneven counts make the two clearly different
    default = flat(step_accelerate(w, loss="default").grads)
    assert abs(rel_error(default, ref) - expected) < 1e-5 * expected
    assert rel_error(default, mom) < 1e-5
    fixed = flat(step_accelerate(w, loss="token-weighted").grads)
    assert rel_error(fixed, ref) < 1e-5


def test_lightning_default_is_mean_of_means():
    w, groups = _window()
    ref = _hand_grads(groups, mean_of_means=False)
    mom = _hand_grads(groups, mean_of_means=True)
    got = flat(step_lightning(w, loss="default").grads)
    assert rel_error(got, mom) < 1e-5
    assert abs(rel_error(got, ref) - rel_error(mom, ref)) < 1e-5


def test_trainer_llama_gradient_is_the_big_batch_one():
    cfg = RunConfig(model="hf:LlamaForCausalLM", model_config=TINY_LLAMA, seq_len=32, micro_batch=4, accumulation=3,
                    dataset_size=32)
    rows = hf_rows(cfg, hf_model(cfg.section("model"), cfg.section("run")))
    assert len(set(rows.counts)) == 3
    got = flat(step_hf_trainer(rows, micro_batch=4, accumulation=3).grads)
    # Independent: every row alone through the same initial weights, CE sum / all predicted tokens.
    model = rows.model.build()
    groups = [[{"input_ids": r["input_ids"][:-1], "labels": r["labels"][1:]} for r in g] for g in rows.groups]
    ref = _grads_of(model, groups, False, lambda m, ids: m(input_ids=ids).logits)
    mom = _grads_of(model, groups, True, lambda m, ids: m(input_ids=ids).logits)
    assert rel_error(got, ref) < 1e-5  # exact: it normalised by the window's tokens
    assert rel_error(mom, ref) > 0.05  # and the window is uneven enough for a mean of means to show


def test_accelerate_report_keeps_accumulation_apart_from_normalisation():
    r = verify_framework(RunConfig(model_config="n_layer=1,d_model=32,n_head=2", seq_len=32, micro_batch=4,
                                   accumulation=3, dataset_size=32), framework="accelerate")
    assert not r.passed and r.accumulation_error.found and "mean of means" in r.accumulation_error.cause
    assert r.normalisation.rel_error < 1e-5 and not r.normalisation.found  # one micro-batch's mean is the token mean
    assert r.mean_of_means_rel_error < 1e-5


def test_cli_accelerate_json_and_missing_tool(tmp_path, monkeypatch):
    before = snapshot(tmp_path)
    r = cli(["verify", "--framework", "accelerate", "--json", *TINY_GPT], cwd=tmp_path)
    assert r.rc == 1
    d = json.loads(r.out)
    acc = d["accumulation_error"]
    assert d["framework"] == "accelerate" and not d["passed"] and "mean of means" in acc["cause"]
    assert "gather" in acc["fix"] and len(set(d["loss_tokens"])) == len(d["loss_tokens"])
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    r = cli(["verify", "--framework", "lightning", *TINY_GPT], cwd=tmp_path)
    check_promise(r, tmp_path, before)
    assert r.rc == 2 and "trainfit[lightning]" in r.err and r.out == ""
