"""Tell a limit of the fake-tensor trace apart from an input the real step refuses too.

The estimator runs the step on fake tensors: each op runs its meta kernel, a shape/dtype rule written apart from the
real kernel. Where a meta kernel is stricter than the real one (``aten._grouped_mm``'s bf16-only rule on torch 2.13,
before :mod:`trainfit.meters.experts`), the trace fails on a step that runs -- and the task's first-forward check
blamed the user's ``--model-config``. :func:`meta_refusal` finds the op whose fake kernel failed (the frame of torch's
fake dispatch in the error's traceback) and runs the real CPU kernel on zero-filled inputs of the same shapes, dtypes
and strides: if it runs, the failure is the trace's, not the input's.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
from torch.utils._pytree import tree_map

from trainfit.errors import one_line

REAL_BYTES = 256 * 2**20
"""Largest inputs the real kernel is tried on (bytes): beyond, the failure is not judged (the input is blamed)."""


def _failed_op(tb: TracebackType | None) -> tuple[Any, tuple, dict] | None:
    """(op, args, kwargs) of the innermost fake-tensor dispatch in traceback ``tb``."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "_dispatch_impl" and code.co_filename.endswith("fake_tensor.py"):
            loc = tb.tb_frame.f_locals
            if "func" in loc and "args" in loc:
                found = (loc["func"], loc["args"], loc.get("kwargs") or {})
        tb = tb.tb_next
    return found


def _real(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu").zero_()


def _real_kernel_runs(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func``'s real CPU kernel runs on zero-filled inputs like ``args`` (bounded by :data:`REAL_BYTES`)."""
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    size = sum(math.prod(t.shape) * t.element_size() for t in tensors)
    if not tensors or size > REAL_BYTES:
        return False
    try:
        with torch.no_grad():
            func(*tree_map(_real, args), **tree_map(_real, kwargs))
    except Exception:  # noqa: BLE001 - the real kernel refuses too: the input's failure, not the trace's
        return False
    return True


def meta_refusal(error: BaseException) -> str:
    """'op: message' when ``error`` (or the error it replaced, ``__context__``: the task's one-line refusal) came
    from a fake kernel that refused what the real CPU kernel runs; '' otherwise."""
    for e in (error, error.__context__):
        if e is None:
            continue
        found = _failed_op(e.__traceback__)
        if found is not None and _real_kernel_runs(*found):
            return f"{found[0]}: {one_line(str(e), 300)}"
    return ""


@contextlib.contextmanager
def quiet_fake_failures() -> Iterator[None]:
    """Within the block, torch's fake-tensor dispatch does not log the traceback of a failing meta kernel to stderr
    (pages of ``E... failed while attempting to run meta`` lines before the one-line refusal); the error itself
    still propagates."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    before = fake_log.disabled
    fake_log.disabled = True
    try:
        yield
    finally:
        fake_log.disabled = before
