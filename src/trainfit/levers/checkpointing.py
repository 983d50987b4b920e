"""Activation checkpointing: trade recompute for activation memory.

Pure core (``levers/checkpointing_rules.py``, torch-free, which the planner imports too): a policy (a small
frozen dataclass per variant, a typed name of the vocabulary: :func:`trainfit.vocabulary.parse_checkpoint_policy`),
:func:`select_blocks`, which decides *which* modules to checkpoint, :func:`budget_block_count` (how many blocks a
memory budget needs) and the op table :data:`SAVED_OPS` of selective checkpointing. Thin torch shell: :func:`apply_checkpointing`
replaces each chosen module's ``forward`` with a non-reentrant ``torch.utils.checkpoint.checkpoint``
call. Module structure and state-dict keys are unchanged, so checkpoints load across policies, and
sharding can wrap the same blocks after.

The policies:

- ``full`` / ``every:K`` / ``class:Name``: whole modules are checkpointed; every checkpointed block's
  forward runs twice (once more during backward), so backward FLOPs rise by one forward of those blocks;
  memory saved is the block's saved activations minus its input, which stays alive.
- ``selective`` (op level): every block is checkpointed with a selective-checkpoint context
  (``create_selective_checkpoint_contexts``): the outputs of the ops in :data:`SAVED_OPS` (matmuls and
  attention, the expensive ones) are kept, everything else (pointwise ops, norms, views) is recomputed in
  backward -- most of a block's saved bytes for almost none of its FLOPs.
- ``budget:F``: keep at most ``F`` of the activation bytes the blocks keep un-checkpointed. Eager (or a
  torch without the knob): trainfit checkpoints the fewest whole blocks that meet it
  (:func:`budget_block_count`, the first blocks); under ``compile`` with a torch that has
  ``torch._functorch.config.activation_memory_budget``, that knob is set to ``F`` instead and the
  partitioner chooses what to recompute. :func:`checkpoint_choice` says which was used.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._functorch.config as functorch_config
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import CheckpointPolicy as SavePolicy
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from trainfit.errors import ConfigError
from trainfit.levers.checkpointing_rules import (  # torch-free: the planner reads the same rules
    ALTERNATE_MATMULS,
    SAVED_OPS,
    budget_block_count,
    select_blocks,
)
from trainfit.meters.attention import recompute_context
from trainfit.meters.tracker import MemoryTracker
from trainfit.vocabulary import (
    CHECKPOINT_SPECS,
    ByClassName,
    CheckpointPolicy,
    EveryBlock,
    EveryKthBlock,
    MemoryBudget,
    NoCheckpointing,
    SelectiveOps,
    parse_checkpoint_policy,
)


def _ops(names: Sequence[str]) -> frozenset:
    return frozenset(op for op in (getattr(torch.ops.aten, n, None) for n in names) if op is not None)


_SAVED = _ops(tuple(SAVED_OPS))
_ALTERNATE = _ops(ALTERNATE_MATMULS)


def _selective_context(tag: Callable[[torch.Tensor], Any] | None = None):
    """A fresh (forward, recompute) context pair for one checkpointed call, with its own matmul counter.

    ``tag``: the memory tracker's pack hook, called on each kept output (torch keeps those in the
    checkpoint's own cache, not through saved-tensor hooks, so the tracker would count them as
    temporaries). Needs a torch whose policy sees ``ctx.op_output`` (2.10+); older ones are not tagged.
    """
    count: dict[bool, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs) -> SavePolicy:
        op = func.overloadpacket
        decision = SavePolicy.MUST_SAVE if op in _SAVED else SavePolicy.PREFER_RECOMPUTE
        if op in _ALTERNATE:
            count[ctx.is_recompute] += 1
            if count[ctx.is_recompute] % 2 == 0:
                decision = SavePolicy.PREFER_RECOMPUTE
        out = getattr(ctx, "op_output", None)
        if tag is not None and decision == SavePolicy.MUST_SAVE and not ctx.is_recompute and out is not None:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    tag(t)
        return decision

    return create_selective_checkpoint_contexts(policy)


@dataclass(kw_only=True)
class CheckpointChoice:
    """What a policy did to a model (``checkpoint_choice(model)``): for the run's log and the reports."""

    spec: str
    """The policy, as typed."""
    how: str
    """"blocks" (whole blocks), "ops" (selective, op level) or "compile" (activation_memory_budget)."""
    names: list[str] = field(default_factory=list)
    """Checkpointed modules (for budget:F eager: filled at the first forward, when the blocks are measured)."""
    n_blocks: int = 0
    kept_fraction: float | None = None
    """budget:F: share of the un-checkpointed blocks' activation bytes kept (from the measured ratio)."""

    def line(self) -> str:
        """One line for the run's log."""
        if self.how == "compile":
            return (f"checkpointing {self.spec}: torch.compile's activation_memory_budget={self.spec[7:]} "
                    "(the partitioner chooses what to recompute)")
        if self.how == "ops":
            return (f"checkpointing {self.spec}: {len(self.names)} blocks, matmul and attention outputs kept "
                    "(every second mm/addmm recomputed), other ops recomputed")
        if self.spec.startswith("budget:"):
            if self.kept_fraction is None:
                return f"checkpointing {self.spec}: blocks chosen at the first forward"
            return (f"checkpointing {self.spec}: trainfit's choice of blocks, the first {len(self.names)} of "
                    f"{self.n_blocks} checkpointed, keeping {self.kept_fraction:.2f} of the blocks' activations")
        return f"checkpointing {self.spec}: {len(self.names)} modules checkpointed"


def checkpoint_choice(model: nn.Module) -> CheckpointChoice | None:
    """What :func:`apply_checkpointing` did to ``model`` (None: nothing applied)."""
    return getattr(model, "_trainfit_checkpoint_choice", None)


# -- the torch shell -------------------------------------------------------------------------------------------
def _recomputable(original):
    """``original`` run under the estimator's target-kernel mode again when autograd recomputes it
    (``meters.attention.recompute_context``: the mode is not on the stack inside backward)."""
    def run(*args, **kwargs):
        with recompute_context():
            return original(*args, **kwargs)
    return run


def _checkpointed_forward(original, *args, **kwargs):
    # Non-reentrant: works with kwargs, with inputs that do not require grad, and under FSDP2.
    return checkpoint(_recomputable(original), *args, use_reentrant=False, **kwargs)


def _tracker_pack() -> Callable[[torch.Tensor], Any] | None:
    """The memory tracker's pack hook when a tracker is the innermost saved-tensor hook (else None)."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, TypeError, RuntimeError):
        return None
    pack = hooks[0] if hooks else None
    return pack if isinstance(getattr(pack, "__self__", None), MemoryTracker) else None


def _selective_forward(original, *args, **kwargs):
    # Under torch.compile the hook stack is not traceable (a graph break); a compiled step is not tagged.
    tag = None if torch.compiler.is_compiling() else _tracker_pack()
    context = functools.partial(_selective_context, tag)
    return checkpoint(_recomputable(original), *args, use_reentrant=False, context_fn=context, **kwargs)


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def measure_kept_ratio(module: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> float:
    """Bytes ``module`` keeps checkpointed (its tensor inputs) / bytes it saves for backward un-checkpointed.

    Runs its forward once more on one sample of the batch (the ratio does not depend on the batch: both
    sides grow with it), under the caller's autocast so dtypes are the real ones, with every dispatch mode
    set aside (the memory tracker and FLOP counter around the step do not see it). Under the estimator's
    fake tensors it runs on fakes: nothing allocated. Parameters (saved by matmuls) are not activations and
    are left out.
    """
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    fake_mode = next((t.fake_mode for t in leaves if isinstance(t, FakeTensor)), None)
    batch = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() else 0
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = _storage_key(t)
        if k is not None:
            saved[k] = t.untyped_storage().nbytes()
        return t

    def one_sample(x):
        if isinstance(x, torch.Tensor) and batch > 1 and x.dim() and x.shape[0] == batch:
            return x[:1].clone()  # its own storage: the input counted is one sample's
        return x

    with _disable_current_modes(), (fake_mode or contextlib.nullcontext()):
        sargs, skwargs = tree_map(one_sample, (args, kwargs))
        params = {_storage_key(p) for p in (*module.parameters(), *module.buffers())}
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward(*sargs, **skwargs)
        inputs = {_storage_key(t): t.untyped_storage().nbytes()
                  for t in tree_leaves(sargs) if isinstance(t, torch.Tensor)}
        del out
    s = sum(n for k, n in saved.items() if k not in params)
    kept = sum(n for k, n in inputs.items() if k not in params)
    return kept / s if s else 1.0


class _Budget:
    """budget:F on whole blocks: measures block 0 at the model's first forward, then checkpoints the first c."""

    def __init__(self, policy: MemoryBudget, blocks: list[nn.Module], choice: CheckpointChoice,
                 names: list[str]) -> None:
        self.policy, self.blocks, self.choice, self.block_names = policy, blocks, choice, names
        self.count: int | None = None

    def forward(self, index: int, original, *args, **kwargs):
        if self.count is None:
            r = measure_kept_ratio(self.blocks[index], original, args, kwargs)
            self.count = budget_block_count(len(self.blocks), self.policy.fraction, r)
            self.choice.names = self.block_names[:self.count]
            L, c = len(self.blocks), self.count
            self.choice.kept_fraction = ((L - c) + c * r) / L if L else 1.0
            # The user gave a fraction; which blocks that became is said once, on stderr (one line in the CLI).
            warnings.warn(self.choice.line(), stacklevel=1)
        if index < self.count:
            return _checkpointed_forward(original, *args, **kwargs)
        return original(*args, **kwargs)


def has_compile_budget() -> bool:
    """This torch has ``torch._functorch.config.activation_memory_budget`` (2.4+)."""
    return hasattr(functorch_config, "activation_memory_budget")


def apply_checkpointing(model: nn.Module, policy: CheckpointPolicy, block_names: Sequence[str], *,
                        compiled: bool = False) -> list[str]:
    """Apply the policy to ``model`` in place; returns the checkpointed module names (budget:F eager: the
    blocks it may checkpoint; the first forward decides, :func:`checkpoint_choice` then holds the chosen).

    Args:
        compiled: the model will run under ``torch.compile``: budget:F then sets the compiler's
            ``activation_memory_budget`` (process-wide: AOTAutograd reads it when it partitions) instead
            of choosing blocks.
    Raises:
        ConfigError: a class-name policy that matches no module (the lever would do nothing); selective
            or budget on a model without repeated blocks.
    """
    modules = dict(model.named_modules())
    if isinstance(policy, (SelectiveOps, MemoryBudget)) and not block_names and not (
            compiled and isinstance(policy, MemoryBudget) and has_compile_budget()):
        raise ConfigError("checkpointing", policy.spec, "none, full or class:Name for this model",
                          "it declares no repeated blocks to checkpoint")
    if isinstance(policy, MemoryBudget) and compiled and has_compile_budget():
        functorch_config.activation_memory_budget = float(policy.fraction)
        choice = CheckpointChoice(spec=policy.spec, how="compile", n_blocks=len(block_names))
        model._trainfit_checkpoint_choice = choice
        warnings.warn(choice.line(), stacklevel=1)  # which mechanism was used, where the user sees it
        return []
    names = select_blocks(policy, block_names, [(n, type(m).__name__) for n, m in modules.items()],
                          kept_ratio=0.0)
    if isinstance(policy, ByClassName) and not names:
        present = sorted({type(m).__name__ for m in modules.values()})
        raise ConfigError("checkpointing", policy.spec, present[:30], "no module has that class name")
    how = "ops" if isinstance(policy, SelectiveOps) else "blocks"
    choice = CheckpointChoice(spec=policy.spec, how=how, names=list(names), n_blocks=len(block_names))
    budget = None
    if isinstance(policy, MemoryBudget):  # every block may be chosen: wrap them all, the first forward decides
        names, choice.names = list(block_names), []
        budget = _Budget(policy, [modules[n] for n in block_names], choice, list(block_names))
    for i, name in enumerate(names):
        mod = modules[name]
        if getattr(mod, "_trainfit_checkpointed", False):
            continue
        # Instance attribute shadows the class's forward; nn.Module.__call__ (and its hooks,
        # e.g. FSDP2's) still runs around it, so wrapping order with sharding is preserved.
        if budget is not None:
            mod.forward = functools.partial(budget.forward, i, mod.forward)
        elif how == "ops":
            mod.forward = functools.partial(_selective_forward, mod.forward)
        else:
            mod.forward = functools.partial(_checkpointed_forward, mod.forward)
        mod._trainfit_checkpointed = True
    if names or budget is not None:
        model._trainfit_checkpoint_choice = choice
    return names


__all__ = ["ALTERNATE_MATMULS", "CHECKPOINT_SPECS", "SAVED_OPS", "ByClassName", "CheckpointChoice",
           "CheckpointPolicy", "EveryBlock", "EveryKthBlock", "MemoryBudget", "NoCheckpointing", "SelectiveOps",
           "apply_checkpointing", "budget_block_count", "checkpoint_choice", "has_compile_budget",
           "measure_kept_ratio", "parse_checkpoint_policy", "select_blocks"]
