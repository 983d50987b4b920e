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

Every part is checked where it is used, cheaply (a type, shape and ``requires_grad`` look per call): a
model without trainable parameters, ``batch(n)`` returning None, a loss that is a per-item vector,
has no gradient (a constant, or detached) or raises, is reported in one line naming the callable,
the part of the protocol it broke and where the protocol is written (:data:`PROTOCOL_DOC`), not as
a traceback from the middle of a step.

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
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from trainfit.errors import ModelError, TrainfitError
from trainfit.tasks.base import GenericTask

_TASK_METHODS = ("build_model", "dataset", "collate", "count", "loss", "block_names")
_SPEC_FIELDS = ("model", "batch", "loss")
PROTOCOL = ("a trainfit Task, or an object/dict with model (nn.Module or factory), batch(n) and "
            "loss(model, batch) -> (loss_sum, count); see trainfit.tasks.user")
PROTOCOL_DOC = "docs/memory.md, section Models; src/trainfit/tasks/user.py"
"""Where the module:callable protocol is written, named in every error about breaking it."""
MODEL_RULE = "model must be an nn.Module (or a factory returning one) with parameters that require grad"
BATCH_RULE = "batch(n) must return a micro-batch of n samples (tensors, or a dict/list/tuple of them)"
LOSS_RULE = ("loss(model, batch) must return (loss_sum tensor, count): a scalar sum that requires grad, and a "
             "count that is an int or a one-element tensor")
_NOT_USER = (str(Path(torch.__file__).resolve().parent), str(Path(__file__).resolve().parents[1]))
"""torch's and trainfit's own source: the frames an error report skips to find the user's line."""


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


def _broke(spec: str, rule: str, what: str) -> ModelError:
    return ModelError(f"model={spec!r}: {what}; {rule} (protocol: {PROTOCOL_DOC})")


def _where(e: BaseException) -> str:
    """`` (at file.py:LINE)``: the innermost frame of the user's code (not torch's, not trainfit's)."""
    frames = traceback.extract_tb(e.__traceback__)
    user = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_NOT_USER)]
    f = (user or frames or [None])[-1]
    return f" (at {Path(f.filename).name}:{f.lineno})" if f is not None else ""


def _raised(spec: str, rule: str, part: str, e: Exception) -> ModelError:
    text = str(e).splitlines()[0] if str(e) else ""
    return _broke(spec, rule, f"{part} raised {type(e).__name__}: {text}{_where(e)}")


def _passes_through(e: BaseException, *tensors: Any) -> bool:
    """Errors that are not the user's to fix here, raised unchanged: trainfit's own, out-of-memory (auto-fit
    re-cuts the step), and anything on the meta device (FLOP counting falls back to CPU on its errors)."""
    if isinstance(e, (TrainfitError, MemoryError, torch.OutOfMemoryError)):
        return True
    if torch.get_default_device().type == "meta":
        return True
    leaves = torch.utils._pytree.tree_leaves(tensors)
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in leaves)


def _checked_model(spec: str, m: Any) -> nn.Module:
    if not isinstance(m, nn.Module):
        raise _broke(spec, MODEL_RULE, f"the model is a {type(m).__name__}, not an nn.Module")
    if not any(p.requires_grad for p in m.parameters()):
        n = sum(1 for _ in m.parameters())
        raise _broke(spec, MODEL_RULE, f"its {type(m).__name__} has no parameters to train"
                     + (f" ({n} parameters, none requires grad)" if n else ""))
    return m


def _checked_loss_output(spec: str, out: Any) -> Any:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        if isinstance(out, torch.Tensor):
            got = f"a tensor of shape {tuple(out.shape)}"
        else:
            got = type(out).__name__ + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
        raise _broke(spec, LOSS_RULE, f"loss(model, batch) returned {got}")
    loss_sum, count = out
    if not isinstance(loss_sum, torch.Tensor):
        raise _broke(spec, LOSS_RULE, f"loss(model, batch) returned a sum that is a {type(loss_sum).__name__}, "
                     "not a tensor")
    if loss_sum.numel() != 1:
        raise _broke(spec, LOSS_RULE, f"loss(model, batch) returned a sum of shape {tuple(loss_sum.shape)} "
                     "(per-item losses? return their .sum())")
    if torch.is_grad_enabled() and not loss_sum.requires_grad:
        raise _broke(spec, LOSS_RULE, "loss(model, batch) returned a sum that does not require grad (a constant, "
                     "or detached from the model's output)")
    if isinstance(count, bool) or not isinstance(count, (int, torch.Tensor)) \
            or (isinstance(count, int) and count < 0) or (isinstance(count, torch.Tensor) and count.numel() != 1):
        shown = f"shape {tuple(count.shape)}" if isinstance(count, torch.Tensor) else repr(count)
        raise _broke(spec, LOSS_RULE, f"loss(model, batch) returned a count of {shown}")
    return out


def _check_build(spec: str, build: Callable[[], Any]) -> Callable[[], nn.Module]:
    def checked() -> nn.Module:
        try:
            m = build()
        except Exception as e:
            if _passes_through(e):
                raise
            raise _raised(spec, MODEL_RULE, "building the model", e) from None
        return _checked_model(spec, m)

    checked._trainfit_checked = True
    return checked


def _check_batch(spec: str, make: Callable[..., Any], part: str) -> Callable[..., Any]:
    def checked(arg):
        try:
            b = make(arg)
        except Exception as e:
            if _passes_through(e):
                raise
            raise _raised(spec, BATCH_RULE, part, e) from None
        if b is None:
            raise _broke(spec, BATCH_RULE, f"{part} returned None")
        return b

    checked._trainfit_checked = True
    return checked


def _check_loss(spec: str, loss_fn: Callable[[nn.Module, Any], Any]) -> Callable[[nn.Module, Any], Any]:
    def checked(m, b):
        try:
            out = loss_fn(m, b)
        except Exception as e:
            if _passes_through(e, b, next(m.parameters(), None)):
                raise
            raise _raised(spec, LOSS_RULE, "loss(model, batch)", e) from None
        return _checked_loss_output(spec, out)

    checked._trainfit_checked = True
    return checked


def check_task(spec: str, task: Any) -> Any:
    """A user's full Task with its model, collate and loss checked against the protocol (in place, so
    the Task's own references to itself stay valid); a Task that cannot be changed is used as it is."""
    for name, wrap in (("build_model", _check_build), ("loss", _check_loss),
                       ("collate", lambda s, f: _check_batch(s, f, "collate(samples)")),
                       ("example_batch", lambda s, f: _check_batch(s, f, "example_batch(n)"))):
        f = getattr(task, name, None)
        if not callable(f) or getattr(f, "_trainfit_checked", False):
            continue
        try:
            setattr(task, name, wrap(spec, f))
        except (AttributeError, TypeError):  # frozen dataclass, __slots__, a property
            return task
    return task


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

    batch = _check_batch(spec, batch_fn, "batch(n)")
    count = _get(obj, "count") or _first_dim
    return GenericTask(name=spec, unit=_get(obj, "unit") or "samples", build_model=_check_build(spec, build),
                       dataset=lambda: _Indices(dataset_size), collate=lambda idx: batch(len(idx)),
                       count=count, loss=_check_loss(spec, loss_fn),
                       block_classes=tuple(_get(obj, "block_classes") or ()), example_batch=batch)


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
        return check_task(spec, obj)
    if all(_get(obj, f) is not None for f in _SPEC_FIELDS):
        return task_from_spec(spec, obj, dataset_size=dataset_size)
    raise ModelError(f"model={spec!r} returned {type(obj).__name__}; it must return {PROTOCOL}")
