"""The standard optimizer groups: weight decay on weight matrices only.

Decoupled weight decay pulls every decayed weight towards zero each step. That is the point for the
matrices of linear and convolution layers; it is harm for the rest, the common recipe (GPT-2/nanoGPT,
Hugging Face's Trainer, torchtitan) leaves out:

    biases, norm weights and scales    any parameter with ndim < 2: no decay (they set offsets and scales)
    embeddings                         parameters of nn.Embedding / nn.EmbeddingBag modules: no decay (a row
                                       is only updated when its token appears; decay would shrink rare rows)
    a head tied to the embedding       the same Parameter object as the embedding, so the same answer

Pure core: :func:`decays` (a parameter's facts -> decay or not). Thin shell: :func:`param_groups` reads them
off the model BY NAME and IDENTITY (``named_parameters``, module types), in the model's parameter order,
over the trainable parameters only (a frozen parameter gets no optimizer state), and hands the optimizer
the tensors the precision says it updates (the fp32 master copies of ``*-true`` precisions: the i-th
master belongs to the i-th trainable parameter, :meth:`Precision.optimizer_params`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def decays(*, ndim: int, embedding: bool) -> bool:
    """Whether weight decay applies to a parameter: weight matrices (ndim >= 2) that are not embeddings."""
    return ndim >= 2 and not embedding


def embedding_ids(model: nn.Module) -> set[int]:
    """``id`` of every parameter held by an embedding module (a tied head's weight is one of them)."""
    return {id(p) for m in model.modules() if isinstance(m, _EMBEDDINGS) for p in m.parameters(recurse=False)}


@dataclass(frozen=True, kw_only=True)
class GroupSplit:
    """Which trainable parameters decay, by name, in the model's order."""

    decay: tuple[str, ...]
    no_decay: tuple[str, ...]


def split(model: nn.Module) -> GroupSplit:
    """The trainable parameters of ``model`` by name, split into decayed and not decayed."""
    emb = embedding_ids(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if decays(ndim=p.ndim, embedding=id(p) in emb) else no_decay).append(name)
    return GroupSplit(decay=tuple(decay), no_decay=tuple(no_decay))


def param_groups(model: nn.Module, params: list[torch.Tensor], weight_decay: float) -> list[dict]:
    """The optimizer's param groups over ``params`` (what the precision says the optimizer updates).

    Args:
        model: the (possibly wrapped) model; its trainable parameters, in order, correspond 1:1 to ``params``.
        params: ``precision.optimizer_params(model)``.
        weight_decay: the decay of the weight matrices.

    Returns:
        ``[{"params": all}]`` when ``weight_decay`` is 0 (one group, as before: nothing to tell apart); else a
        decayed group then an undecayed one (``weight_decay`` 0.0), empty groups left out, order kept.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if len(named) != len(params):  # internal invariant: precision.optimizer_params follows the model's order
        raise RuntimeError(f"{len(params)} optimizer params for {len(named)} trainable model parameters")
    if weight_decay == 0:
        return [{"params": list(params)}]
    emb = embedding_ids(model)
    decay, rest = [], []
    for (_, p), opt_p in zip(named, params):
        (decay if decays(ndim=p.ndim, embedding=id(p) in emb) else rest).append(opt_p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def summary(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Per param group: its weight decay, number of tensors and of elements (zero1: all ranks' parameters)."""
    return [{"weight_decay": float(g.get("weight_decay", 0.0)), "tensors": len(g["params"]),
             "elements": sum(p.numel() for p in g["params"])} for g in optimizer.param_groups]
