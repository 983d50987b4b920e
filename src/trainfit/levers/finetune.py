"""Fine-tuning levers: frozen parameters (``--freeze``) and LoRA adapters through ``peft`` (``--lora``).

Both act on the model as the task built it, before checkpointing, precision and the strategy wrap it,
so patterns and targets name the model's own parameters and modules (``model.layers.0.self_attn.q_proj``).

A frozen parameter has ``requires_grad=False``: autograd computes no gradient for it, the precision's
``optimizer_params`` leaves it out (no optimizer state, no fp32 master copy), DDP skips it in its
buckets and FSDP2 reduce-scatters only the parameters that have gradients. So per frozen parameter the
step holds its weight only -- the memory tracker and the estimate count it that way.

LoRA (Hu et al., 2021) freezes every base weight and adds ``B @ A`` (rank r, scaled by alpha / r) beside
each targeted Linear; only A and B train. The pure parts (which names a pattern or a target matches,
the merged weight) are functions of names and tensors; the shells apply them to a module.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from trainfit.errors import ConfigError, ModelError
from trainfit.vocabulary import LoraSpec, freeze_patterns, lora_target_matches, match_frozen

PEFT_PREFIX = "base_model.model."
"""What ``peft.get_peft_model`` puts before every module and parameter name of the model it wraps."""

_LORA_TYPES = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_LORA_TYPE_NAMES = ("Conv1D",)  # transformers.pytorch_utils.Conv1D (GPT-2): peft supports it, torch has no class


# -- pure cores (the freeze and target rules are the vocabulary's, shared with plan.trainable) -----------
split_patterns = freeze_patterns
target_matches = lora_target_matches


def frozen_names(names: Iterable[str], spec: str) -> list[str]:
    """The parameter names ``spec``'s fnmatch patterns select, in model order (:func:`vocabulary.match_frozen`)."""
    return match_frozen(list(names), spec)


def unmatched_target(modules: Mapping[str, str], targets: Iterable[str]) -> str | None:
    """The first target naming no adaptable module (``modules``: name -> "adaptable" or its class), or None."""
    for t in targets:
        if not any(target_matches(n, t) and kind == "adaptable" for n, kind in modules.items()):
            return t
    return None


def merged_state_dict(sd: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A LoRA model's state dict with every adapter merged into its base weight, under the base model's names.

    ``W' = W + scaling * (B @ A)`` for each Linear (``scaling = alpha / r``), as ``peft``'s
    ``merge_and_unload`` computes it; ``base_model.model.`` and ``.base_layer`` leave the names, the adapter
    tensors leave the dict. Computed in fp32.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if ".lora_" in key:
            continue
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        name = name.replace(".base_layer.", ".")
        out[name] = value
        stem, _, leaf = key.rpartition(".base_layer.")
        if stem and leaf == "weight":
            a, b = sd.get(f"{stem}.lora_A.default.weight"), sd.get(f"{stem}.lora_B.default.weight")
            if a is not None and b is not None:
                if a.dim() != 2 or b.dim() != 2:
                    raise ModelError(f"LoRA merge: {stem} is not a Linear adapter; export it unmerged")
                out[name] = (value.float() + scaling * (b.float() @ a.float())).to(value.dtype)
    return out


def base_name(name: str) -> str:
    """A module or parameter name of a LoRA-wrapped model as the unwrapped model spells it."""
    name = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
    return name.replace(".base_layer.", ".")


# -- torch shells ------------------------------------------------------------------------------------------
def freeze(model: nn.Module, spec: str) -> list[str]:
    """Set ``requires_grad=False`` on the parameters ``spec`` selects; returns their names."""
    if not split_patterns(spec):
        return []
    params = dict(model.named_parameters())
    chosen = frozen_names(params, spec)
    for n in chosen:
        params[n].requires_grad_(False)
    return chosen


def _kind(m: nn.Module) -> str:
    return "adaptable" if isinstance(m, _LORA_TYPES) or type(m).__name__ in _LORA_TYPE_NAMES else type(m).__name__


def _peft():
    try:
        import peft
    except ImportError:
        raise ModelError("--lora needs the peft package; install it with `pip install 'trainfit[lora]'`") from None
    return peft


def apply_lora(model: nn.Module, spec: LoraSpec, *, task_type: str | None = None) -> nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` with ``spec``'s adapters (base weights frozen).

    Works for transformers models and plain modules alike (peft's generic LoraModel); ``task_type``
    ("CAUSAL_LM", ...) makes the adapter config loadable by ``AutoPeftModelFor...``.

    Raises:
        ConfigError: ``lora.targets`` naming no Linear/Embedding/Conv module (listing a few that exist).
    """
    modules = {n: _kind(m) for n, m in model.named_modules() if n}
    missing = unmatched_target(modules, spec.targets) if spec.targets else "(none given)"
    if missing is not None:
        linear = [n.rsplit(".", 1)[-1] for n, k in modules.items() if k == "adaptable"]
        examples = ", ".join(list(dict.fromkeys(linear))[:6])
        raise ConfigError("lora.targets", missing,
                          f"names of Linear, Embedding or Conv modules in this model, e.g. {examples}",
                          "a target matches a module's name or its last dotted parts")
    peft = _peft()
    if task_type is None and getattr(model, "config", None) is not None and \
            type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        task_type = "CAUSAL_LM"  # a transformers causal LM: its adapter loads with AutoPeftModelForCausalLM
    config = peft.LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                             lora_dropout=spec.dropout, task_type=task_type)
    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated question; not the user's concern
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return peft.get_peft_model(model, config)
    except (ValueError, TypeError) as e:  # a target type peft cannot adapt, found after our own check
        raise ConfigError("lora.targets", ",".join(spec.targets), "modules peft can adapt (Linear, Embedding, "
                          "Conv)", f"peft: {str(e).splitlines()[0][:200]}") from None


def lora_block_names(model: nn.Module, names: list[str]) -> list[str]:
    """Block names found by the task on the unwrapped model, as they are called inside ``model`` (a peft
    wrapper puts ``base_model.model.`` before them); names already right are kept."""
    known = {n for n, _ in model.named_modules()}
    return [n if n in known or PEFT_PREFIX + n not in known else PEFT_PREFIX + n for n in names]
