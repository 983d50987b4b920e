"""Activation checkpointing's rules, torch-free: which modules a policy checkpoints, how many blocks a memory
budget needs, and which ops selective checkpointing keeps. The torch shell (``levers/checkpointing.py``)
applies them to a model; the planner (``plan/recompute.py``) prices them from a shape. Neither restates them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from trainfit.vocabulary import (
    ByClassName,
    CheckpointPolicy,
    EveryBlock,
    EveryKthBlock,
    MemoryBudget,
    NoCheckpointing,
    SelectiveOps,
)

SAVED_OPS: dict[str, str] = {
    "mm": "matmul without bias (Llama's projections): O(n^3) FLOPs for O(n^2) bytes, the costliest to redo",
    "addmm": "matmul with bias (nn.Linear with a bias: GPT's projections), same reason",
    "bmm": "batched matmul (attention written out by hand, MoE experts), same reason",
    "baddbmm": "batched matmul with an added term (some attention kernels' QK^T + mask), same reason",
    "linear": "nn.Linear where a backend keeps it whole instead of decomposing it into addmm/mm",
    "_scaled_dot_product_flash_attention": "fused attention (CUDA flash): quadratic in the sequence to redo",
    "_scaled_dot_product_efficient_attention": "fused attention (memory-efficient kernel), same reason",
    "_scaled_dot_product_cudnn_attention": "fused attention (cuDNN), same reason",
    "_scaled_dot_product_flash_attention_for_cpu": "fused attention on CPU, same reason",
    "_scaled_dot_product_fused_attention_overrideable": "fused attention of out-of-tree backends, same reason",
}
"""aten ops whose outputs selective checkpointing keeps (name -> why); every other op in a block is
recomputed in backward: pointwise ops (GELU, SiLU, adds, dropout masks), norms and views cost little
compute per byte they would keep. Looked up by name so a torch lacking one still loads this module."""

ALTERNATE_MATMULS = ("mm", "addmm")
"""Matmuls of which every second one in a block is recomputed rather than kept (torchtitan's op-level
policy, ``torchtitan/distributed/activation_checkpoint.py``): in a GPT block that is the attention and
MLP output projections, whose outputs only feed the residual add. It halves the kept matmul outputs
for one extra matmul in two, and it is why selective's recompute FLOPs sit between none's and full's."""


# -- which blocks ---------------------------------------------------------------------------------------------
def budget_block_count(n_blocks: int, fraction: float, kept_ratio: float) -> int:
    """The fewest whole blocks to checkpoint so that the blocks keep at most ``fraction`` of what they keep
    un-checkpointed (pure).

    The blocks are identical: each keeps S bytes un-checkpointed and ``kept_ratio`` x S checkpointed (its
    input stays alive), so c checkpointed blocks keep ``(L - c) S + c r S <= F L S``, i.e.
    ``c >= L (1 - F) / (1 - r)``; capped at L (``F`` below ``r`` is then unreachable: see
    :class:`CheckpointChoice`'s ``kept_fraction``).
    """
    if n_blocks <= 0 or fraction >= 1.0:
        return 0
    if kept_ratio >= 1.0:
        return n_blocks
    need = n_blocks * (1.0 - fraction) / (1.0 - kept_ratio)
    return min(n_blocks, math.ceil(need - 1e-9))


def select_blocks(policy: CheckpointPolicy, blocks: Sequence[str], all_modules: Sequence[tuple[str, str]],
                  *, kept_ratio: float = 0.0) -> list[str]:
    """Decide which modules to checkpoint (pure).

    Args:
        policy: the checkpointing policy.
        blocks: qualified names of the model's repeated blocks, in order.
        all_modules: (qualified name, class name) of every module, for class-name policies.
        kept_ratio: budget:F only -- bytes a checkpointed block keeps / bytes it keeps un-checkpointed.
    Returns:
        Qualified names of the modules to checkpoint, outermost only. ``budget:F`` takes the *first*
        blocks: backward recomputes them last, when the later blocks' saved tensors are already freed, so
        the recompute adds to the smallest live set.
    """
    match policy:
        case NoCheckpointing():
            return []
        case EveryBlock() | SelectiveOps():
            return list(blocks)
        case EveryKthBlock(k=k):
            return [b for i, b in enumerate(blocks) if i % k == 0]
        case MemoryBudget(fraction=f):
            return list(blocks[:budget_block_count(len(blocks), f, kept_ratio)])
        case ByClassName(names=names):
            chosen = [n for n, cls in all_modules if cls in names and n]
            # Outermost only: a checkpointed parent already recomputes its children.
            return [n for n in chosen if not any(n != p and n.startswith(p + ".") for p in chosen)]
    raise AssertionError(policy)


__all__ = ["ALTERNATE_MATMULS", "SAVED_OPS", "budget_block_count", "select_blocks"]
