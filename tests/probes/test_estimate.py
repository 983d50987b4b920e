"""Estimate (fake tensors) against measurement (real step), and the block shortcut against the full trace."""

import pytest

from trainfit.config import make_config
from trainfit.probes.estimate import estimate_memory, shard_parts
from trainfit.probes.memory import measure_memory
from trainfit.vocabulary import PARTS

HF_TINY = {
    "hf:LlamaForCausalLM": "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,"
                           "num_key_value_heads=1,vocab_size=64,max_position_embeddings=32",
    "hf:BertForMaskedLM": "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,"
                          "vocab_size=64,max_position_embeddings=32",
    "hf:T5ForConditionalGeneration": "d_model=32,d_ff=64,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=16,"
                                     "vocab_size=64",
    "hf:ViTForImageClassification": "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,"
                                    "image_size=8,patch_size=4,num_labels=4",
}
BUILTIN = {"gpt-tiny": "n_layer=2,d_model=32,n_head=2", "cnn": "channels=4"}
PRECISIONS = ("fp32", "bf16-mixed", "fp16-true")
CHECKPOINTING = ("none", "full")


def _cfg(model, mc, precision, checkpointing, **kw):
    return make_config(dict(model=model, model_config=mc, precision=precision, checkpointing=checkpointing,
                            seq_len=8, micro_batch=2, accumulation=1, **kw))


def _assert_close(measured, estimated, rel=0.03):
    for p in PARTS:
        m, e = measured.parts[p], estimated.parts[p]
        assert abs(m - e) <= rel * max(m, 1), (p, m, e)
    assert abs(measured.peak_bytes - estimated.peak_bytes) <= rel * measured.peak_bytes
    assert measured.peak_phase == estimated.peak_phase


def _matrix(models):
    return [pytest.param(m, mc, p, c, id=f"{m}-{p}-{c}") for m, mc in models.items()
            for p in PRECISIONS for c in CHECKPOINTING]


@pytest.mark.parametrize("model,mc,precision,ckpt", _matrix(BUILTIN))
def test_estimate_matches_measurement_builtin(model, mc, precision, ckpt):
    cfg = _cfg(model, mc, precision, ckpt)
    _assert_close(measure_memory(cfg), estimate_memory(cfg))


@pytest.mark.hf
@pytest.mark.parametrize("model,mc,precision,ckpt", _matrix(HF_TINY))
def test_estimate_matches_measurement_hf(model, mc, precision, ckpt):
    pytest.importorskip("transformers")
    cfg = _cfg(model, mc, precision, ckpt)
    _assert_close(measure_memory(cfg), estimate_memory(cfg))


def _same(a, b):
    da, db = a.to_dict(), b.to_dict()
    for k in ("wall_s", "details"):
        da.pop(k), db.pop(k)
    assert da == db


@pytest.mark.parametrize("precision,ckpt", [("fp32", "none"), ("bf16-true", "full")])
def test_block_shortcut_equals_full_trace_gpt(precision, ckpt):
    cfg = _cfg("gpt-tiny", "n_layer=6,d_model=32,n_head=2", precision, ckpt, optimizer="adamw")
    short = estimate_memory(cfg)
    assert "traced 3 and 4 of 6" in short.details["shortcut"]
    _same(short, estimate_memory(cfg, shortcut=False))


@pytest.mark.hf
def test_block_shortcut_equals_full_trace_llama():
    pytest.importorskip("transformers")
    mc = HF_TINY["hf:LlamaForCausalLM"].replace("num_hidden_layers=1", "num_hidden_layers=6")
    cfg = make_config(dict(model="hf:LlamaForCausalLM", model_config=mc, precision="bf16-mixed", seq_len=8,
                           micro_batch=1, accumulation=1))
    short = estimate_memory(cfg)
    assert "traced 3 and 4 of 6" in short.details["shortcut"]
    _same(short, estimate_memory(cfg, shortcut=False))


def test_zero_sharding_divides_the_sharded_parts_only():
    cfg = _cfg("gpt-tiny", BUILTIN["gpt-tiny"], "fp32", "none")
    r = estimate_memory(cfg)
    z3 = shard_parts(r, "zero3", 4)
    assert z3.params_bytes == r.params_bytes // 4 and z3.optimizer_bytes == r.optimizer_bytes // 4
    assert z3.activations_bytes == r.activations_bytes
    z1 = shard_parts(r, "zero1", 4)
    assert z1.params_bytes == r.params_bytes and z1.grads_bytes == r.grads_bytes
    saved = r.peak_parts["optimizer"] - r.peak_parts["optimizer"] // 4
    assert z1.peak_bytes == r.peak_bytes - saved


@pytest.mark.hf
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_causal_lm_estimate_takes_the_real_mask_branch(precision):
    """At 64 tokens a materialised (batch, 1, 64, 64) causal mask is ~5% of the peak: under fake
    tensors transformers cannot rule out packed sequences and builds one; a real step passes
    is_causal to SDPA instead. The estimate must take the real branch (peak equal to the byte)."""
    pytest.importorskip("transformers")
    mc = HF_TINY["hf:LlamaForCausalLM"].replace("max_position_embeddings=32", "max_position_embeddings=64")
    cfg = make_config(dict(model="hf:LlamaForCausalLM", model_config=mc, precision=precision, seq_len=64,
                           micro_batch=3, accumulation=1))
    measured, estimated = measure_memory(cfg), estimate_memory(cfg)
    assert estimated.peak_bytes == measured.peak_bytes
    assert estimated.parts == measured.parts
