"""Activation checkpointing: same numbers, more backward FLOPs (counted with FlopCounterMode)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from trainfit.errors import ConfigError
from trainfit.levers.checkpointing import (
    ByClassName,
    EveryBlock,
    EveryKthBlock,
    NoCheckpointing,
    apply_checkpointing,
    parse_checkpoint_policy,
    select_blocks,
)
from trainfit.tasks.make import make_task

TINY = "n_layer=4,d_model=32,n_head=2"


def _forward_flops_per_block():
    """FLOPs of each block's forward pass alone, counted on an un-checkpointed forward."""
    task = make_task("gpt-tiny", model_config=TINY, seq_len=16)
    model = task.build_model()
    ds = task.dataset()
    batch = task.collate([ds[i] for i in range(4)])
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(batch["input_ids"])
    return {k: sum(v.values()) for k, v in fc.get_flop_counts().items()}


def _loss_grads_flops(policy, early_stop=True):
    task = make_task("gpt-tiny", model_config=TINY, seq_len=16)
    model = task.build_model()
    names = apply_checkpointing(model, policy, task.block_names(model))
    ds = task.dataset()
    batch = task.collate([ds[i] for i in range(4)])
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop), FlopCounterMode(display=False) as fc:
        loss_sum, n = task.loss(model, batch)
        (loss_sum / n).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return loss_sum.item(), grads, fc.get_total_flops(), fc.get_flop_counts(), names


def test_same_loss_and_gradients_and_recompute_is_counted():
    loss0, g0, flops0, _, _ = _loss_grads_flops(NoCheckpointing())
    fwd = _forward_flops_per_block()
    for policy, expect in ((EveryBlock(), [0, 1, 2, 3]), (EveryKthBlock(k=2), [0, 2])):
        loss1, g1, flops1, _, names = _loss_grads_flops(policy)
        assert names == [f"blocks.{i}" for i in expect]
        assert loss1 == loss0
        assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(g1, g0))
        # Backward now re-runs each checkpointed block's forward: exactly its forward FLOPs.
        fwd_of_blocks = sum(fwd[f"GPT.blocks.{i}"] for i in expect)
        assert fwd_of_blocks > 0
        # By default recompute stops early once every saved tensor is back (the last matmul
        # of each block is not needed), so the extra is positive and at most one forward.
        assert 0 < flops1 - flops0 <= fwd_of_blocks
        # Without early stop it is exactly one forward of every checkpointed block.
        flops_full = _loss_grads_flops(policy, early_stop=False)[2]
        assert flops_full - flops0 == fwd_of_blocks


def test_by_class_name_and_selection_are_pure():
    mods = [("", "GPT"), ("blocks.0", "Block"), ("blocks.0.attn", "Attn"), ("blocks.1", "Block")]
    assert select_blocks(ByClassName(names=("Block", "Attn")), ["blocks.0", "blocks.1"], mods) == ["blocks.0", "blocks.1"]
    assert select_blocks(EveryKthBlock(k=3), [f"b{i}" for i in range(7)], []) == ["b0", "b3", "b6"]
    assert parse_checkpoint_policy("class:Block").spec == "class:Block"


def test_bad_policies_name_the_field():
    with pytest.raises(ConfigError, match="checkpointing='sometimes'"):
        parse_checkpoint_policy("sometimes")
    with pytest.raises(ConfigError, match="every:K"):
        parse_checkpoint_policy("every:0")
    task = make_task("gpt-tiny", model_config=TINY, seq_len=16)
    model = task.build_model()
    with pytest.raises(ConfigError, match="no module has that class name"):
        apply_checkpointing(model, ByClassName(names=("NoSuchLayer",)), task.block_names(model))
