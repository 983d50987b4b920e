"""meters.attention: the target device's SDPA kernel (pure rules), and the fake trace that follows it.

References: the rules as stated by hand from PyTorch's sdp_utils.cpp (pure tests); torch's own CPU
dispatcher (``aten::_fused_sdp_choice`` on real tensors) for the ``cpu`` rule; byte counts computed by
hand from the flash kernel's saved set (q, k, v, out, logsumexp fp32, rng state); plain PyTorch for the
numerics of the math route and for dropout's saved mask.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from trainfit.errors import ConfigError
from trainfit.meters.attention import (CPU_FLASH, CUDNN, EFFICIENT, FLASH, MATH, choose_sdpa_kernel,
                                       fused_saved_bytes, gpu_optimizer_defaults, hf_attention_note, target_kernels)


def _choose(target="h100", *, torch_version=(2, 8), **over):
    facts = dict(dtype="bf16", head_dim=64, has_attn_mask=False, mask_requires_grad=False, dropout_p=0.0,
                 is_causal=True, enable_gqa=False, q_len=1024, kv_len=1024, requires_grad=True)
    facts.update(over)
    return choose_sdpa_kernel(target, torch_version=torch_version, **facts).name


# --------------------------------------------------------------------------------------- (a) pure rules

@pytest.mark.parametrize(("target", "tv", "over", "want"), [
    ("h100", (2, 8), {}, FLASH),                                    # bf16 + causal + no mask
    ("h100", (2, 11), {}, CUDNN),                                   # sm90, torch >= 2.11: cuDNN first
    ("h200", (2, 11), {}, CUDNN),
    ("a100", (2, 11), {}, FLASH),                                   # cuDNN preference is sm90/sm100 only
    ("h100", (2, 11), {"dropout_p": 0.1}, FLASH),                   # 0.1 is not a multiple of 1/16
    ("h100", (2, 11), {"dropout_p": 0.125}, CUDNN),
    ("h100", (2, 8), {"dtype": "fp32"}, EFFICIENT),                 # flash is half-only
    ("h100", (2, 8), {"dtype": "fp32", "head_dim": 66}, MATH),      # efficient fp32 needs % 4
    ("h100", (2, 8), {"dtype": "fp32", "head_dim": 68}, EFFICIENT),
    ("h100", (2, 8), {"head_dim": 512}, EFFICIENT),                 # > 256: no flash; efficient has no cap
    ("h100", (2, 11), {"head_dim": 512}, EFFICIENT),
    ("h100", (2, 8), {"head_dim": 510}, MATH),                      # neither a multiple of 8 nor <= 256
    ("h100", (2, 8), {"head_dim": 100}, FLASH),                     # flash pads 100 -> 104
    ("h100", (2, 8), {"has_attn_mask": True, "is_causal": False}, EFFICIENT),   # explicit float mask
    ("h100", (2, 11), {"has_attn_mask": True, "is_causal": False}, CUDNN),
    ("a100", (2, 8), {"q_len": 512}, EFFICIENT),                    # flash's causal needs a square
    ("l4", (2, 8), {"head_dim": 256, "dropout_p": 0.1}, EFFICIENT),  # sm89 training, (224, 256] + dropout
    ("l4", (2, 8), {"head_dim": 256}, FLASH),
    ("l4", (2, 8), {"head_dim": 208}, EFFICIENT),                   # sm89 training, (192, 224]
    ("l4", (2, 8), {"head_dim": 208, "requires_grad": False}, FLASH),
    ("a100", (2, 8), {"num_heads": 8, "num_kv_heads": 2, "enable_gqa": True}, FLASH),
    ("a100", (2, 8), {"num_heads": 8, "num_kv_heads": 2, "enable_gqa": True, "has_attn_mask": True,
                      "is_causal": False}, MATH),                   # GQA + mask: efficient has no GQA
    ("a100", (2, 8), {"num_heads": 8, "num_kv_heads": 2}, MATH),    # heads differ without enable_gqa
    ("h100", (2, 8), {"dtype": "fp64"}, MATH),
])
def test_gpu_rules_stated_by_hand(target, tv, over, want):
    assert _choose(target, torch_version=tv, **over) == want


def test_unknown_target_and_dtype_refused():
    with pytest.raises(ConfigError, match="device"):
        _choose("tpu")
    with pytest.raises(ConfigError, match="dtype"):
        _choose(dtype="int8")
    with pytest.raises(ConfigError, match="device"):
        with target_kernels("v100"):
            pass


@pytest.mark.parametrize(("dtype", "kw"), [
    (torch.float32, {}), (torch.float32, {"dropout_p": 0.1}), (torch.bfloat16, {"is_causal": True}),
    (torch.float32, {"attn_mask": torch.zeros(16, 16)}), (torch.bfloat16, {"dropout_p": 0.2}),
])
def test_cpu_rule_matches_torchs_cpu_dispatcher(dtype, kw):
    q = torch.randn(1, 2, 16, 8, dtype=dtype, requires_grad=True)
    torch_says = torch.ops.aten._fused_sdp_choice(q, q, q, **kw)  # 0 math, 1 flash (real CPU tensors)
    ours = choose_sdpa_kernel("cpu", dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype], head_dim=8,
                              has_attn_mask="attn_mask" in kw, mask_requires_grad=False,
                              dropout_p=kw.get("dropout_p", 0.0), is_causal=kw.get("is_causal", False),
                              enable_gqa=False, q_len=16, kv_len=16, requires_grad=True).name
    assert {0: MATH, 1: CPU_FLASH}[torch_says] == ours


# ---------------------------------------------------------------- (b, c) a transformers LM traced for h100

class _SavedInSdpa(TorchFunctionMode):
    """Unique storages autograd saves while an sdpa call runs (entered inside target_kernels: sees it first)."""

    def __init__(self):
        super().__init__()
        self.nbytes: dict[StorageWeakRef, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)

        def pack(t):
            self.nbytes[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return func(*args, **kwargs)


def _gpt2_step(target):
    transformers = pytest.importorskip("transformers")
    B, S, D, H = 2, 1024, 64, 2
    with FakeTensorMode():
        cfg = transformers.GPT2Config(n_layer=1, n_embd=D, n_head=H, vocab_size=128, n_positions=S,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg).train()
        ids = torch.randint(0, 128, (B, S))
        with target_kernels(target) as record, _SavedInSdpa() as spy, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # training, as tasks/hf.py sets it
        loss.backward()
        grads = [(p.grad.shape, p.grad.dtype, p.shape, p.dtype) for p in model.parameters()]
    return sum(spy.nbytes.values()), record, grads, (B, S, D, H), model


@pytest.mark.hf
def test_hf_gpt2_attention_saves_the_flash_set_on_h100_and_more_on_cpu():
    h100_bytes, record, grads, (B, S, D, H), model = _gpt2_step("h100")
    # GPT-2 defaults: attn_pdrop 0.1 -> cuDNN refuses (not a multiple of 1/16), flash takes it
    assert [c.kernel for c in record.calls] == [FLASH] and record.calls[0].cpu_kernel == MATH
    # by hand: q, k, v are views of one bf16 c_attn output (B, S, 3D); out (B, H, S, D/H) bf16;
    # logsumexp (B, H, S) fp32; rng state: philox seed + offset (two uint64 words) + one unused uint64 word
    qkv, out, lse, rng = B * S * 3 * D * 2, B * S * D * 2, B * H * S * 4, 2 * 8 + 8
    assert h100_bytes == qkv + out + lse + rng
    assert record.unpacked_assumed == 1                  # no (B, 1, S, S) mask built (see test_hf_fake_mask)
    cpu_bytes, cpu_record, _, _, _ = _gpt2_step("cpu")
    assert cpu_record.calls == []                        # cpu: the trace is left alone
    assert cpu_bytes > h100_bytes + B * H * S * S * 2    # math keeps (B, H, S, S) probabilities (and more)
    # (c) backward ran: every parameter has a gradient of its own shape and dtype
    assert all(g[0] == g[2] and g[1] == g[3] for g in grads)
    assert "sdpa" in hf_attention_note(model, "h100") and "h100" in hf_attention_note(model, "h100")
    assert any("dropout" in line for line in record.lines())


@pytest.mark.hf
def test_hf_llama_gqa_routes_without_expanding_kv():
    transformers = pytest.importorskip("transformers")
    B, S, H, KV, hd = 1, 256, 4, 2, 16
    with FakeTensorMode():
        cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=H * hd, intermediate_size=128,
                                       num_attention_heads=H, num_key_value_heads=KV, vocab_size=128,
                                       max_position_embeddings=S)
        model = transformers.LlamaForCausalLM(cfg).train()
        ids = torch.randint(0, 128, (B, S))
        with target_kernels("a100", torch_version=(2, 11)) as record, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        assert all(p.grad.shape == p.shape for p in model.parameters())
    (call,) = record.calls
    assert call.kernel == FLASH and call.kv_shape == (B, KV, S, hd) and call.dtype == "bf16"


@pytest.mark.parametrize(("target", "tv", "dtype", "kw", "want"), [
    ("h100", (2, 8), torch.bfloat16, {"is_causal": True, "dropout_p": 0.1}, FLASH),
    ("h100", (2, 11), torch.bfloat16, {"is_causal": True}, CUDNN),
    ("h100", (2, 8), torch.float32, {"is_causal": True}, EFFICIENT),      # L = 100: lse padded to 128
])
def test_fused_saved_bytes_equal_the_traced_kernel(target, tv, dtype, kw, want):
    B, H, L, D = 2, 4, 100, 40
    with FakeTensorMode():
        q, k, v = (torch.randn(B, H, L, D, dtype=dtype, requires_grad=True) for _ in range(3))
        with target_kernels(target, torch_version=tv) as record, _SavedInSdpa() as spy:
            F.scaled_dot_product_attention(q, k, v, **kw)
    assert record.calls[0].kernel == want
    assert sum(spy.nbytes.values()) == fused_saved_bytes(want, batch=B, num_heads=H, num_kv_heads=H, q_len=L,
                                                         kv_len=L, head_dim=D, dtype_bytes=dtype.itemsize)
    with pytest.raises(ConfigError, match="kernel"):
        fused_saved_bytes(MATH, batch=B, num_heads=H, num_kv_heads=H, q_len=L, kv_len=L, head_dim=D, dtype_bytes=2)


# ------------------------------------------------------------------------- other ops, numerics of routes

@pytest.mark.hf
def test_hf_fake_mask():
    """Without a cache, transformers cannot tell fake position_ids from a packed batch and builds a (B, 1, S, S)
    mask, though a real run passes none (checked on real tensors here); target_kernels answers "unpacked"."""
    transformers = pytest.importorskip("transformers")
    with FakeTensorMode():
        cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg).train()
        ids = torch.randint(0, 64, (1, 64))
        with target_kernels("a100") as record, _MaskSpy() as fake_spy, torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids, use_cache=False)
        with _MaskSpy() as fake_plain:
            model(input_ids=ids, use_cache=False)
    real = transformers.GPT2LMHeadModel(cfg).train()
    with _MaskSpy() as real_spy:
        real(input_ids=torch.randint(0, 64, (1, 64)), use_cache=False)
    assert real_spy.masks == [None] and fake_spy.masks == [None] and fake_plain.masks == [(1, 1, 64, 64)]
    assert record.calls[0].kernel == FLASH and not record.calls[0].has_attn_mask


class _MaskSpy(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.masks = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            self.masks.append(None if mask is None else tuple(mask.shape))
        return func(*args, **kwargs)


def test_math_route_matches_plain_sdpa_and_bool_mask():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 6, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.rand(8, 8) > 0.3
    mask[:, 0] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref.sum().backward()
    ref_grad = q.grad.clone()
    q.grad = None
    with target_kernels("h100") as record:  # fp64 -> math on every CUDA kernel rule
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got.sum().backward()
    assert record.calls[0].kernel == MATH
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(q.grad, ref_grad)


def test_dropout_saves_a_bool_mask_as_cuda_does():
    x = torch.randn(64, 32, requires_grad=True)

    def saved_dtypes(target):
        got = []
        with target_kernels(target), torch.autograd.graph.saved_tensors_hooks(
                lambda t: (got.append(t.dtype), t)[1], lambda t: t):
            y = F.dropout(x, 0.1, training=True)
        return got, y

    cpu, _ = saved_dtypes("cpu")
    gpu, y = saved_dtypes("h100")
    assert cpu == [torch.float32] and gpu == [torch.bool]          # CPU: noise in fp32; CUDA: bool mask
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / 0.9)             # kept elements scaled by 1/(1-p)


def test_cuda_autocast_fp32_list_applies_under_cpu_autocast():
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.nn.functional.linear(x, torch.randn(8, 8))      # bf16 under either autocast
        plain = torch.pow(h, 3.0)
        with target_kernels("h100") as record:
            cuda_like = torch.pow(h, 3.0)
            soft = h.softmax(-1)
            kept = torch.pow(h, 3.0, out=torch.empty_like(h))     # out=: not eligible, as in autocast
    assert plain.dtype == torch.bfloat16
    assert cuda_like.dtype == torch.float32 and soft.dtype == torch.float32 and kept.dtype == torch.bfloat16
    assert record.fp32_casts == 2


def test_optimizer_takes_foreach_where_unset():
    p = torch.nn.Parameter(torch.zeros(3))
    unset = torch.optim.AdamW([p])
    chosen = torch.optim.AdamW([p], foreach=False)
    assert len(gpu_optimizer_defaults(unset)) == 1 and unset.param_groups[0]["foreach"] is True
    assert gpu_optimizer_defaults(chosen) == [] and chosen.param_groups[0]["foreach"] is False


def test_optimizer_steps_with_foreach_inside_a_gpu_target_only():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    inside, after = torch.optim.AdamW([p]), torch.optim.AdamW([p])
    with target_kernels("a100") as record:
        inside.step()
    after.step()  # the hook is gone after the block
    assert inside.param_groups[0]["foreach"] is True and after.param_groups[0]["foreach"] is None
    assert record.foreach_groups == 1 and any("foreach" in line for line in record.lines())


def test_hf_note_for_other_models():
    assert "not a transformers model" in hf_attention_note(torch.nn.Linear(2, 2))


def test_checkpointed_blocks_recompute_with_the_target_kernels():
    """Autograd drops torch-function modes in backward; the checkpoint's recompute re-enters the target's, so it
    saves what the forward saved (else torch.utils.checkpoint refuses the mismatch)."""
    from trainfit.config import make_config
    from trainfit.probes.estimate import estimate_memory

    def est(ck):
        cfg = make_config({"model": "gpt-tiny", "model_config": "n_layer=2,d_model=32,n_head=2", "seq_len": 64,
                           "checkpointing": ck, "precision": "bf16-mixed", "micro_batch": 2, "accumulation": 1})
        return estimate_memory(cfg, target="h100")

    full, none = est("full"), est("none")
    assert full.activations_bytes < none.activations_bytes
    assert any("runs cudnn" in n or "runs flash" in n or "runs efficient" in n for n in full.notes)
