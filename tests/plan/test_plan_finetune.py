"""trainfit plan for fine-tuning (--lora, --freeze): what trains, against a hand calculation, the built models'
own parameters, peft itself and autograd's saved tensors."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import warnings

import pytest
import torch

from trainfit.errors import ConfigError
from trainfit.plan.basis import analytic_basis
from trainfit.plan.shapes import shape_of
from trainfit.plan.trainable import parameters, trainable
from trainfit.presets import GPT_PRESETS
from trainfit.tasks.gpt import GPT
from trainfit.vocabulary import parse_lora
from tests.reliability.cli_harness import cli, error_lines

transformers = pytest.importorskip("transformers")

LLAMA_7B_PARAMS = 32000 * 4096 * 2 + 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 4096
"""Embedding + head, 32 x (q, k, v, o + gate, up, down + 2 RMSNorms), final norm: 6,738,415,616."""

GPT_CFG = "n_layer=3,d_model=32,n_head=4,vocab_size=64,max_seq_len=32"
LLAMA_CFG = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, vocab_size=128)


def _llama_spec(**extra) -> str:
    return ",".join(f"{k}={v}" for k, v in {**LLAMA_CFG, **extra}.items())


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(GPT_PRESETS["gpt-tiny"], n_layer=3, d_model=32, n_head=4, vocab_size=64,
                                   max_seq_len=32))


def _llama(**extra):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_CFG, **extra))


def test_llama_7b_lora_by_hand():
    shape = shape_of("llama-7b")
    assert shape.n_params == LLAMA_7B_PARAMS == 6_738_415_616
    t = trainable(shape, lora=parse_lora("r=8,alpha=16,targets=q_proj,v_proj"))
    assert t.n_trainable == 32 * 2 * 8 * (4096 + 4096) == 4_194_304
    assert t.n_params == LLAMA_7B_PARAMS + 4_194_304 and t.n_trainable_tensors == 32 * 2 * 2
    assert "4,194,304" in t.description and "0.06%" in t.description
    b = analytic_basis(shape, precision="fp32", checkpointing="none", seq_len=128, trainable=t)
    assert b.params_bytes == (LLAMA_7B_PARAMS + 4_194_304) * 4  # every weight is held
    assert b.grads_bytes == 4_194_304 * 4 and b.optimizer_bytes == 4_194_304 * 8  # AdamW: 2 fp32 moments
    assert b.grad_comm_bytes == 4_194_304 * 4
    # bf16-true: bf16 weights for all, the fp32 master copy (and its fp32 gradient) only for the adapters
    b16 = analytic_basis(shape, precision="bf16-true", checkpointing="none", seq_len=128, trainable=t)
    assert b16.params_bytes == (LLAMA_7B_PARAMS + 4_194_304) * 2
    assert b16.optimizer_bytes == 4_194_304 * (8 + 4) and b16.grads_bytes == 4_194_304 * 4


@pytest.mark.parametrize("extra", [{}, {"attention_bias": True, "mlp_bias": True}, {"tie_word_embeddings": True}])
def test_llama_parameter_names_are_the_built_models(extra):
    spec = _llama_spec(**{k: str(v).lower() for k, v in extra.items()})
    real = [(n, p.numel()) for n, p in _llama(**extra).named_parameters()]
    assert [(n, k) for n, k, _ in parameters(shape_of("hf:LlamaForCausalLM", spec))] == real


def test_gpt_parameter_names_are_the_built_models():
    real = [(n, p.numel()) for n, p in _gpt().named_parameters()]
    assert [(n, k) for n, k, _ in parameters(shape_of("gpt-tiny", GPT_CFG))] == real


@pytest.mark.parametrize("targets", ["q_proj,v_proj", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                                     "layers.1.self_attn.o_proj", "lm_head,down_proj"])
def test_lora_counts_are_peft_s(targets):
    peft = pytest.importorskip("peft")
    spec = parse_lora(f"r=4,alpha=8,targets={targets}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(spec.targets)))
    t = trainable(shape_of("hf:LlamaForCausalLM", _llama_spec()), lora=spec)
    assert t.n_trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert t.n_params == sum(p.numel() for p in model.parameters())
    assert t.n_trainable_tensors == sum(1 for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("freeze", ["tok_emb.*,pos_emb.*", "blocks.0.*,blocks.1.attn.*", "*.bias"])
def test_freeze_counts_are_requires_grad(freeze):
    model = _gpt()
    pats = freeze.split(",")
    kept = [p for n, p in model.named_parameters() if not any(fnmatch.fnmatchcase(n, x) for x in pats)]
    t = trainable(shape_of("gpt-tiny", GPT_CFG), freeze=freeze)
    assert (t.n_trainable, t.n_trainable_tensors) == (sum(p.numel() for p in kept), len(kept))


def _saved_bytes(model, ids) -> int:
    """Bytes autograd saves for backward in one forward (each storage once, parameters left out)."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(x):
        if x.data_ptr() not in params:
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(ids)
    return sum(seen.values())


@pytest.mark.parametrize("freeze", ["blocks.*.attn.qkv.*", "blocks.*.mlp.*"])
def test_a_frozen_linear_s_input_is_not_saved(freeze):
    """Measured with saved_tensors_hooks on the real GPT: freezing qkv (or the MLP) in every block drops exactly
    the inputs the model says (qkv: d per token per block; MLP: fc and proj inputs, d + 4d)."""
    shape = shape_of("gpt-tiny", GPT_CFG)
    ids = torch.randint(0, 64, (2, 32))
    full = _saved_bytes(_gpt(), ids)
    model = _gpt()
    for n, p in model.named_parameters():
        p.requires_grad_(not fnmatch.fnmatchcase(n, freeze))
    frozen = _saved_bytes(model, ids)
    b_full, b_frozen = (analytic_basis(shape, precision="fp32", checkpointing="none", seq_len=32, trainable=t)
                        for t in (None, trainable(shape, freeze=freeze)))
    assert full - frozen == 2 * (b_full.act_per_sample_bytes - b_frozen.act_per_sample_bytes) > 0


def test_lora_activations_stay_above_what_autograd_saves():
    """peft LoRA on a tiny Llama: the plan's activations are at least what is saved (it never under-plans), and
    within 25% (it keeps the norms' and attention's saved tensors of full training, which frozen weights shrink)."""
    peft = pytest.importorskip("peft")
    spec = parse_lora("r=4,alpha=8,targets=q_proj,v_proj")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(spec.targets)))
    ids = torch.randint(0, 128, (2, 32))
    measured = _saved_bytes(model, ids)
    shape = shape_of("hf:LlamaForCausalLM", _llama_spec())
    b = analytic_basis(shape, precision="fp32", checkpointing="none", seq_len=32, trainable=trainable(shape, lora=spec))
    predicted = 2 * b.act_per_sample_bytes
    assert measured <= predicted <= 1.25 * measured


def test_no_backward_below_the_lowest_trainable_block():
    shape = shape_of("gpt-tiny", GPT_CFG)
    t = trainable(shape, freeze="tok_emb.*,pos_emb.*,blocks.0.*,blocks.1.*")
    assert t.lowest_block == 2
    full = analytic_basis(shape, precision="fp32", checkpointing="none", seq_len=32)
    b = analytic_basis(shape, precision="fp32", checkpointing="none", seq_len=32, trainable=t)
    # by hand: 3 blocks of equal forward F; full step = 3 x forward; here blocks 0, 1 run forward only and
    # block 2 skips no weight gradient -> saved 2 x 2F of backward FLOPs; the head is unchanged
    block_f = shape.block_forward_flops_per_token(32) * 32
    assert full.model_flops_per_sample - b.model_flops_per_sample == pytest.approx(2 * 2 * block_f)


def test_refusals_name_what_exists():
    llama = shape_of("llama-7b")
    with pytest.raises(ConfigError, match="q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"):
        trainable(llama, lora=parse_lora("r=8,targets=qkv"))
    with pytest.raises(ConfigError, match="freeze.*model.layers.0.self_attn.q_proj.weight"):
        trainable(llama, freeze="layers.*")
    with pytest.raises(ConfigError, match="at least one parameter to train"):
        trainable(shape_of("gpt-tiny", GPT_CFG), freeze="*")


PLAN = ["plan", "--model", "llama-7b", "--seq", "2048", "--global-batch", "64", "--device-memory", "80GiB",
        "--devices", "8", "--precisions", "bf16-mixed", "--top", "3"]


def test_plan_cli_header_and_smaller_state():
    r = cli([*PLAN, "--lora", "r=8,alpha=16,targets=q_proj,v_proj"])
    assert r.rc == 0, r.err
    first = r.out.splitlines()[0]
    assert first.startswith("trainable parameters: 4,194,304 of 6,742,609,920 (0.06%)")
    j = cli([*PLAN, "--lora", "r=8,alpha=16,targets=q_proj,v_proj", "--json"])
    full = cli([*PLAN, "--json"])
    lora_best, full_best = json.loads(j.out)["plans"][0], json.loads(full.out)["plans"][0]
    assert json.loads(j.out)["notes"][0] == first
    assert lora_best["micro_batch"] >= full_best["micro_batch"]  # less state: at least as large a micro-batch


def test_plan_cli_refuses_a_target_in_one_line():
    r = cli([*PLAN, "--lora", "r=8,targets=c_attn"])
    assert r.rc == 2 and r.out == ""
    lines = error_lines(r.err)
    assert len(lines) == 1 and "lora.targets='c_attn'" in lines[0] and "q_proj" in lines[0]
    r = cli([*PLAN, "--freeze", "nothing.*"])
    assert r.rc == 2 and len(error_lines(r.err)) == 1 and "freeze='nothing.*'" in r.err


def _docs(tmp_path, lengths=(100, 300, 50, 250, 200)):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in lengths))
    return str(path)


def test_plan_data_sizes_activations_for_the_longest_row(tmp_path):
    """--packing off: rows as long as the longest document (300 bytes -> 300 byte tokens + EOD, by hand), so the
    plan equals the plan at --seq 300 without data; --packing on: full --seq rows, the plan at --seq 512."""
    data = _docs(tmp_path)
    mc = "n_layer=2,d_model=32,n_head=2,max_seq_len=512,vocab_size=257"  # the byte tokenizer's 256 ids + EOD
    job = ["plan", "--model", "gpt-tiny", "--model-config", mc, "--global-batch", "8", "--device-memory", "64MiB",
           "--device", "h100", "--top", "4", "--json"]
    off = json.loads(cli([*job, "--seq", "512", "--data", data, "--packing", "off"]).out)
    assert off["notes"][0].startswith("activations sized for rows of 300 tokens: the longest this data produces")
    at_300 = json.loads(cli([*job, "--seq", "300"]).out)
    on = json.loads(cli([*job, "--seq", "512", "--data", data, "--packing", "on"]).out)
    assert "rows of 512 tokens" in on["notes"][0]
    at_512 = json.loads(cli([*job, "--seq", "512"]).out)
    peaks = [[p["peak_bytes_per_device"] for p in r["plans"]] for r in (off, at_300, on, at_512)]
    assert peaks[0] == peaks[1] and peaks[2] == peaks[3] and max(peaks[0]) < max(peaks[2])


def test_plan_data_takes_the_tokenizer_vocabulary_and_refuses_bad_data(tmp_path):
    data = _docs(tmp_path)
    r = cli(["plan", "--model", "gpt-tiny", "--global-batch", "8", "--device-memory", "1GiB", "--seq", "128",
             "--data", data, "--write", str(tmp_path / "PLAN.toml")])
    assert r.rc == 0, r.err
    written = (tmp_path / "PLAN.toml").read_text()
    assert "vocab_size=257" in written and f'data = "{data}"' in written
    bad = cli(["plan", "--model", "gpt-tiny", "--global-batch", "8", "--device-memory", "1GiB",
               "--data", str(tmp_path / "missing.jsonl")])
    assert bad.rc == 2 and bad.out == "" and len(error_lines(bad.err)) == 1 and "data" in bad.err
