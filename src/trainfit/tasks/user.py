"""``module:callable``: a user's own model, through a small protocol.

``trainfit memory --model mypkg.models:make`` imports ``mypkg.models`` and calls ``make``
with whichever of these keyword arguments it accepts: ``model_config`` (the
``--model-config`` text), ``seq_len``, ``seed``. It must return one of:

1. **A simple spec** -- any object (or dict) with
   - ``model``: an ``nn.Module``, or a zero-argument callable that builds one;
   - ``batch(n)``: returns a micro-batch of ``n`` samples (any structure of tensors);
   - ``loss(model, batch)``: returns ``(loss_sum, count)`` -- the *sum* of the per-item
     losses and how many items it covers (so accumulation normalises exactly);
   - optionally ``block_classes`` (class names of the repeated blocks, for checkpointing
     and sharding), ``unit`` ("tokens" or "samples", default "samples") and ``count(batch)``
     (items in a batch before the forward; default: the loss's count is not needed early,
     so the batch's first dimension is used).

   Training on a spec draws every micro-batch from ``batch(n)``; for real data return a
   full Task instead.
2. **A full Task** -- an object with ``build_model``, ``dataset``, ``collate``, ``count``,
   ``loss`` and ``block_names`` (see :class:`trainfit.tasks.base.Task`), e.g. a
   :class:`~trainfit.tasks.base.GenericTask`.

Example::

    def make(seq_len=32, seed=0):
        net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        return {"model": net,
                "batch": lambda n: {"x": torch.randn(n, 16), "y": torch.randint(0, 4, (n,))},
                "loss": lambda m, b: (F.cross_entropy(m(b["x"]), b["y"], reduction="sum"), len(b["y"]))}
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from trainfit.errors import ModelError
from trainfit.tasks.base import GenericTask

_TASK_METHODS = ("build_model", "dataset", "collate", "count", "loss", "block_names")
_SPEC_FIELDS = ("model", "batch", "loss")
PROTOCOL = ("a trainfit Task, or an object/dict with model (nn.Module or factory), batch(n) and "
            "loss(model, batch) -> (loss_sum, count); see trainfit.tasks.user")


def _resolve(spec: str):
    mod_name, _, attr = spec.rpartition(":")
    if not mod_name or not attr:
        raise ModelError(f"model={spec!r}: expected module:callable, e.g. mypkg.models:make")
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or the module itself failing at import
        raise ModelError(f"model={spec!r}: cannot import module {mod_name!r} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); check it is on PYTHONPATH "
                         "and imports on its own") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ModelError(f"model={spec!r}: module {mod_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ModelError(f"model={spec!r}: {attr!r} is a {type(fn).__name__}, not a callable returning {PROTOCOL}")
    return fn


def _call(spec: str, fn, **available: Any):
    try:
        params = inspect.signature(fn).parameters
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        kwargs = {k: v for k, v in available.items() if takes_all or k in params}
    except (TypeError, ValueError):  # builtins without a signature
        kwargs = {}
    try:
        return fn(**kwargs)
    except Exception as e:
        raise ModelError(f"model={spec!r}: calling it raised {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


class _Indices(Dataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> int:
        return i


def _first_dim(batch: Any) -> int:
    for leaf in torch.utils._pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def task_from_spec(spec: str, obj: Any, *, dataset_size: int) -> GenericTask:
    """Turn a simple spec (model, batch, loss) into a GenericTask."""
    model, batch_fn, loss_fn = (_get(obj, f) for f in _SPEC_FIELDS)
    if not (isinstance(model, nn.Module) or callable(model)):
        raise ModelError(f"model={spec!r}: 'model' must be an nn.Module or a factory, got {type(model).__name__}")
    if not callable(batch_fn) or not callable(loss_fn):
        raise ModelError(f"model={spec!r}: 'batch' and 'loss' must be callables ({PROTOCOL})")

    def build() -> nn.Module:
        m = model if isinstance(model, nn.Module) else model()
        if not isinstance(m, nn.Module):
            raise ModelError(f"model={spec!r}: the model factory returned {type(m).__name__}, not an nn.Module")
        return m

    def loss(m, b):
        out = loss_fn(m, b)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)):
            raise ModelError(f"model={spec!r}: loss(model, batch) must return (loss_sum tensor, count), "
                             f"got {type(out).__name__}")
        return out

    count = _get(obj, "count") or _first_dim
    return GenericTask(name=spec, unit=_get(obj, "unit") or "samples", build_model=build,
                       dataset=lambda: _Indices(dataset_size), collate=lambda idx: batch_fn(len(idx)),
                       count=count, loss=loss, block_classes=tuple(_get(obj, "block_classes") or ()),
                       example_batch=batch_fn)


def user_task(spec: str, *, model_config: str = "", seq_len: int = 64, seed: int = 0,
              dataset_size: int = 4096):
    """Import ``module:callable``, call it, and return a Task (see the module docstring).

    Raises:
        ModelError: the module does not import, the name is missing or not callable, the call
            fails, or it returns something that is neither a Task nor a simple spec.
    """
    fn = _resolve(spec)
    torch.manual_seed(seed)
    obj = _call(spec, fn, model_config=model_config, seq_len=seq_len, seed=seed)
    if all(callable(getattr(obj, m, None)) for m in _TASK_METHODS):
        return obj
    if all(_get(obj, f) is not None for f in _SPEC_FIELDS):
        return task_from_spec(spec, obj, dataset_size=dataset_size)
    raise ModelError(f"model={spec!r} returned {type(obj).__name__}; it must return {PROTOCOL}")
