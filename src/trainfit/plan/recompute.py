"""What the op-level and budget checkpointing policies keep and recompute, from a transformer's shape (pure).

The planner's analytic basis (``plan.basis.analytic_basis``) prices ``none``, ``full`` and ``every:K``
from the blocks a policy checkpoints; ``selective`` and ``budget:F`` need two more facts, given here per
token of one block, counted from the ops of ``levers.checkpointing`` (its ``SAVED_OPS`` table and
``ALTERNATE_MATMULS`` rule: every matmul and attention output kept except every second mm/addmm):

- GPT block, in call order: qkv (addmm 1, kept: 3d), attention (kept: out d + logsumexp 1 fp32 per head),
  attention proj (addmm 2, recomputed), fc (addmm 3, kept: f), MLP proj (addmm 4, not kept; nothing after
  it in the block needs it, so recompute stops before it: ``torch.utils.checkpoint``'s early stop).
- Llama block: q (mm 1, kept: q_dim), k (mm 2, recomputed), v (mm 3, kept: kv_dim), attention (kept:
  q_dim + 1 fp32 per head), o (mm 4, recomputed), gate (mm 5, kept: f), up (mm 6, recomputed), down (mm 7,
  kept: d).

Plus the block's input, which a checkpointed block keeps alive (residual dtype). Measured against the
tracker on gpt-tiny and a tiny Llama in ``tests/levers/test_selective_checkpointing.py``.

How many blocks ``budget:F`` checkpoints, and which blocks each policy takes, are the lever's rules
(``levers/checkpointing_rules.py``: ``budget_block_count``, ``select_blocks``), imported here, not restated.

How ``analytic_basis`` uses it (the lead's file; not edited here)::

    sel = selective_cost(shape, seq_len)            # "selective": every block
    tok_kept = d * rb + sel.kept_elems_per_token * cb + sel.kept_fp32_elems_per_token * 4
    kept += tok_kept                                # instead of ``tok`` (or ``d * rb`` under full)
    recomputed = max(recomputed, tok - tok_kept)    # the block's other saved tensors, rebuilt in backward
    recompute += sel.recompute_flops_per_token      # instead of the block's forward FLOPs

    ckpt = budget_indices(shape, fraction, residual_bytes=rb, compute_bytes=cb)   # "budget:F": as full on these
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.levers.checkpointing_rules import budget_block_count, select_blocks
from trainfit.plan.shapes import TransformerShape
from trainfit.vocabulary import ByClassName, MemoryBudget, parse_checkpoint_policy


@dataclass(frozen=True, kw_only=True)
class SelectiveCost:
    """Per token of one block under ``selective``."""

    kept_elems_per_token: int
    """Matmul and attention outputs kept, in the compute dtype."""
    kept_fp32_elems_per_token: int
    """Attention's logsumexp (fp32, one per head)."""
    input_elems_per_token: int
    """The block's input, kept alive by the checkpoint (residual dtype)."""
    recompute_flops_per_token: float
    """Forward FLOPs run again in backward (the recomputed matmuls; pointwise ops are not counted, as
    ``FlopCounterMode`` does not count them)."""


def selective_cost(shape: TransformerShape, seq_len: int) -> SelectiveCost:
    """What one block keeps and recomputes per token under ``selective`` (see the module doc for the ops)."""
    d, f, q, kv, h = shape.d_model, shape.d_ff, shape.q_dim, shape.kv_dim, shape.n_head
    if shape.family == "gpt":
        kept = 3 * d + d + f  # qkv out, attention out, fc out (GPT: q_dim == kv_dim == d)
        flops = 2.0 * d * d  # the attention output projection
    else:
        kept = q + kv + q + f + d  # q, v, attention out, gate, down
        flops = 2.0 * (d * kv + q * d + d * f)  # k, o, up
    return SelectiveCost(kept_elems_per_token=kept, kept_fp32_elems_per_token=h, input_elems_per_token=d,
                         recompute_flops_per_token=flops)


def kept_ratio(shape: TransformerShape, *, residual_bytes: int, compute_bytes: int) -> float:
    """Bytes a checkpointed block keeps (its input) over the bytes it saves un-checkpointed, per token."""
    resid, mm = shape.saved_elems_per_token()
    return shape.d_model * residual_bytes / (resid * residual_bytes + mm * compute_bytes)


def budget_indices(shape: TransformerShape, fraction: float, *, residual_bytes: int = 4,
                   compute_bytes: int = 4) -> frozenset[int]:
    """The blocks ``budget:F`` checkpoints eagerly: the first c (backward recomputes them last, when the
    later blocks' saved tensors are freed)."""
    r = kept_ratio(shape, residual_bytes=residual_bytes, compute_bytes=compute_bytes)
    return frozenset(range(budget_block_count(shape.n_layer, fraction, r)))


def checkpointed_indices(spec: str, shape: TransformerShape, *, residual_bytes: int = 4,
                         compute_bytes: int = 4) -> frozenset[int]:
    """The blocks a policy checkpoints (whole, or op level for ``selective``), every spec included: the lever's own
    :func:`~trainfit.levers.checkpointing_rules.select_blocks` on the shape's blocks (named by index)."""
    policy, n = parse_checkpoint_policy(spec), shape.n_layer
    if isinstance(policy, ByClassName):
        return frozenset(range(n))  # the planner knows no module classes: class:Name taken as every block
    ratio = (kept_ratio(shape, residual_bytes=residual_bytes, compute_bytes=compute_bytes)
             if isinstance(policy, MemoryBudget) else 0.0)
    return frozenset(int(b) for b in select_blocks(policy, [str(i) for i in range(n)], [], kept_ratio=ratio))


__all__ = ["SelectiveCost", "budget_block_count", "budget_indices", "checkpointed_indices", "kept_ratio",
           "selective_cost"]
