"""Frozen parameters and LoRA: no gradient, no optimizer state, nothing moves; memory counts them so."""

from __future__ import annotations

import pytest
import torch

from reliability.cli_harness import check_promise, cli, error_lines, snapshot
from trainfit.config import make_config
from trainfit.levers.finetune import frozen_names, target_matches, unmatched_target
from trainfit.probes.estimate import estimate_memory
from trainfit.probes.memory import measure_memory
from trainfit.run import build_run
from trainfit.vocabulary import PARTS

from .conftest import GPT

LLAMA_MC = ("hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=1,"
            "vocab_size=64,max_position_embeddings=32")
LORA = "r=4,alpha=8,targets=q_proj,v_proj"


def test_patterns_pick_names():
    names = ["emb.weight", "blocks.0.w", "blocks.1.w", "head.weight"]
    assert frozen_names(names, "blocks.*, emb.*") == ["emb.weight", "blocks.0.w", "blocks.1.w"]
    assert target_matches("a.q_proj", "q_proj") and not target_matches("a.xq_proj", "q_proj")
    assert unmatched_target({"a.q_proj": "adaptable", "a.norm": "LayerNorm"}, ["q_proj", "norm"]) == "norm"


def _frozen_run(**kw):
    cfg = make_config(dict(seq_len=8, micro_batch=2, accumulation=2, lr=0.05, **kw))
    run = build_run(cfg)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    b = run.task.example_batch(2)
    for _ in range(2):
        run.step([b, b])
    return run, before


@pytest.mark.parametrize("kw,frozen", [
    (dict(model="gpt-tiny", model_config=GPT, freeze="tok_emb.*,blocks.0.*"),
     lambda n: n.startswith(("tok_emb.", "blocks.0."))),
    (dict(model="gpt-tiny", model_config=GPT, freeze="blocks.*", precision="bf16-true"),
     lambda n: n.startswith("blocks.")),
    (dict(model="hf:LlamaForCausalLM", model_config=LLAMA_MC, lora=LORA), lambda n: "lora_" not in n),
], ids=["freeze", "freeze-bf16-true", "lora"])
def test_frozen_weights_hold_no_grad_and_no_state(kw, frozen):
    run, before = _frozen_run(**kw)
    state = {id(t) for t in run.optimizer.state}
    stepped = {id(t) for t in run.optimizer_params()}
    assert state == stepped and stepped  # the optimizer holds state for what it steps, nothing else
    names = [n for n, _ in run.model.named_parameters()]
    assert any(map(frozen, names)) and not all(map(frozen, names))
    for n, p in run.model.named_parameters():
        assert p.requires_grad is not frozen(n), n
        if frozen(n):
            assert p.grad is None and id(p) not in state, n
            assert torch.equal(p.detach().float(), before[n].float()), f"frozen {n} moved"
    moved = [n for n, p in run.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved


def test_memory_counts_frozen_weights_as_weights_only():
    """Gradient bytes: exactly 4 per trainable parameter (hand count), none for the frozen ones."""
    cfg = make_config(dict(model="gpt-tiny", model_config=GPT, freeze="tok_emb.*,blocks.0.*", seq_len=8,
                           micro_batch=2, accumulation=1))
    report = measure_memory(cfg)
    run = build_run(cfg)
    trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in run.model.parameters())
    assert report.grads_bytes == 4 * trainable < 4 * total
    assert report.params_bytes == 4 * total


@pytest.mark.hf
def test_lora_estimate_matches_measurement():
    pytest.importorskip("peft")
    cfg = make_config(dict(model="hf:LlamaForCausalLM", model_config=LLAMA_MC, lora=LORA, seq_len=8, micro_batch=2,
                           accumulation=1))
    measured, estimated = measure_memory(cfg), estimate_memory(cfg)
    for p in PARTS:
        m, e = measured.parts[p], estimated.parts[p]
        assert abs(m - e) <= 0.03 * max(m, 1), (p, m, e)
    assert abs(measured.peak_bytes - estimated.peak_bytes) <= 0.03 * measured.peak_bytes
    assert measured.peak_phase == estimated.peak_phase


@pytest.mark.parametrize("flag,value,says", [
    ("--lora", "r=4,targets=q_proj,nothing_here", "lora.targets='nothing_here'"),
    ("--freeze", "no.such.*", "freeze='no.such.*'"),
    ("--freeze", "*", "at least one parameter"),
])
def test_a_flag_naming_nothing_is_refused_in_one_line(tmp_path, flag, value, says):
    model = ["--model", "hf:LlamaForCausalLM", "--model-config", LLAMA_MC] if flag == "--lora" else ["--model",
                                                                                                     "gpt-tiny"]
    before = snapshot(tmp_path)
    r = cli(["train", *model, flag, value, "--steps", "1", "--seq-len", "8", "--run-dir", str(tmp_path / "run")])
    check_promise(r, tmp_path, before)
    assert r.rc == 2
    line = next(ln for ln in error_lines(r.err) if ln.startswith("trainfit: error:"))
    assert says in line, line
