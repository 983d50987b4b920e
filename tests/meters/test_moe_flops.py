"""FLOPs of the MoE experts' grouped matmul (``aten._grouped_mm``), which FlopCounterMode's table leaves out."""

import pytest
import torch

from trainfit.meters.flops import flop_counter

pytestmark = pytest.mark.hf


def test_grouped_mm_forward_and_backward_by_hand():
    T, K, N, E = 12, 16, 8, 4  # 12 routed rows over 4 experts (3 each)
    a = torch.randn(T, K, requires_grad=True)
    w = torch.randn(E, K, N, requires_grad=True)
    offs = torch.tensor([3, 6, 9, 12], dtype=torch.int32)
    with flop_counter() as c:
        y = torch.nn.functional.grouped_mm(a, w, offs=offs)
        (y * torch.ones(T, N)).sum().backward()
    # forward, input gradient, weight gradient: 2 T K N each (the elementwise multiply and the sum are not counted)
    assert c.get_total_flops() == 3 * 2 * T * K * N, c.get_total_flops()


@pytest.mark.parametrize("arch,extra", [
    ("Qwen2MoeForCausalLM", dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4)),
    ("MixtralForCausalLM", dict(num_local_experts=4)),
])
def test_grouped_experts_count_as_transformers_eager_experts(arch, extra):
    """The independent reference: transformers' eager experts (one plain matmul per expert over its tokens), which
    FlopCounterMode counts on its own; the grouped experts must count the same."""
    import transformers

    cls = getattr(transformers, arch)
    counts = {}
    for impl in ("eager", "grouped_mm"):
        torch.manual_seed(0)
        config = cls.config_class(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, vocab_size=128, max_position_embeddings=32,
                                  num_experts_per_tok=2, **extra)
        config._experts_implementation = impl
        model = cls(config)
        ids = torch.randint(0, 128, (2, 16))
        with flop_counter() as c:
            model(input_ids=ids, labels=ids).loss.backward()
        counts[impl] = c.get_total_flops()
    assert counts["grouped_mm"] == counts["eager"] > 0, counts
