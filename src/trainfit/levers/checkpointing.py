"""Activation checkpointing: trade recompute for activation memory.

Pure core: a policy (a small frozen dataclass per variant, a typed name of the vocabulary:
:func:`trainfit.vocabulary.parse_checkpoint_policy`) and :func:`select_blocks`,
which decides *which* modules to checkpoint. Thin torch shell: :func:`apply_checkpointing`
replaces each chosen module's ``forward`` with a non-reentrant
``torch.utils.checkpoint.checkpoint`` call. Module structure and state-dict keys are
unchanged, so checkpoints load across policies, and sharding can wrap the same blocks after.

Cost: every checkpointed block's forward runs twice (once more during backward), so
backward FLOPs rise by one forward of those blocks; memory saved is the block's saved
activations minus its input, which stays alive.
"""

from __future__ import annotations

import functools
from typing import Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint

from trainfit.errors import ConfigError
from trainfit.vocabulary import (
    CHECKPOINT_SPECS,
    ByClassName,
    CheckpointPolicy,
    EveryBlock,
    EveryKthBlock,
    NoCheckpointing,
    parse_checkpoint_policy,
)


def select_blocks(policy: CheckpointPolicy, blocks: Sequence[str], all_modules: Sequence[tuple[str, str]]) -> list[str]:
    """Decide which modules to checkpoint (pure).

    Args:
        policy: the checkpointing policy.
        blocks: qualified names of the model's repeated blocks, in order.
        all_modules: (qualified name, class name) of every module, for class-name policies.
    Returns:
        Qualified names of the modules to checkpoint, outermost only.
    """
    match policy:
        case NoCheckpointing():
            return []
        case EveryBlock():
            return list(blocks)
        case EveryKthBlock(k=k):
            return [b for i, b in enumerate(blocks) if i % k == 0]
        case ByClassName(names=names):
            chosen = [n for n, cls in all_modules if cls in names and n]
            # Outermost only: a checkpointed parent already recomputes its children.
            return [n for n in chosen if not any(n != p and n.startswith(p + ".") for p in chosen)]
    raise AssertionError(policy)


def _checkpointed_forward(original, *args, **kwargs):
    # Non-reentrant: works with kwargs, with inputs that do not require grad, and under FSDP2.
    return checkpoint(original, *args, use_reentrant=False, **kwargs)


def apply_checkpointing(model: nn.Module, policy: CheckpointPolicy, block_names: Sequence[str]) -> list[str]:
    """Apply the policy to ``model`` in place; returns the checkpointed module names.

    Raises:
        ConfigError: a class-name policy that matches no module (the lever would do nothing).
    """
    modules = dict(model.named_modules())
    names = select_blocks(policy, block_names, [(n, type(m).__name__) for n, m in modules.items()])
    if isinstance(policy, ByClassName) and not names:
        present = sorted({type(m).__name__ for m in modules.values()})
        raise ConfigError("checkpointing", policy.spec, present[:30], "no module has that class name")
    for name in names:
        mod = modules[name]
        if getattr(mod, "_trainfit_checkpointed", False):
            continue
        # Instance attribute shadows the class's forward; nn.Module.__call__ (and its hooks,
        # e.g. FSDP2's) still runs around it, so wrapping order with sharding is preserved.
        mod.forward = functools.partial(_checkpointed_forward, mod.forward)
        mod._trainfit_checkpointed = True
    return names


__all__ = ["CHECKPOINT_SPECS", "ByClassName", "CheckpointPolicy", "EveryBlock", "EveryKthBlock", "NoCheckpointing",
           "apply_checkpointing", "parse_checkpoint_policy", "select_blocks"]
