"""The experts' grouped matmul under fake tensors, as the real kernel runs it.

transformers' mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral, DeepSeek-V3, gpt-oss, ...) run their
experts through ``torch.nn.functional.grouped_mm`` (``aten._grouped_mm``) by default. The real kernels take fp32,
bf16 and fp16 (checked on torch 2.13's CPU kernel, forward and backward), but torch's Python meta kernel
(``torch/_meta_registrations.py``, ``_meta_grouped_mm_common``) still carries the checks of the first CUDA kernel and
refuses anything but bf16 -- so an fp32 or bf16-mixed step (whose expert weights are fp32) cannot be traced, and the
estimate failed with "Expected inputs of BF16 type" while the real step runs.

Why a fake kernel and not transformers' eager experts for the trace: the estimate must hold the tensors the real
step holds, and the real step runs the grouped kernel (its saved inputs, its one output per matmul); tracing the
eager per-expert loop instead would count a different set of activations and temporaries. So, while a trace runs,
:func:`grouped_mm_fake_kernel` gives the fake mode a kernel with the real kernel's output (shape, dtype, contiguous
strides) and its dtype rule; outside it torch's own meta kernel is untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager

GROUPED_MM = torch.ops.aten._grouped_mm.default
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What the real grouped matmul takes (torch 2.13, CPU: forward and backward checked)."""


def _out_size(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> list[int]:
    """The output shape of ``_grouped_mm(a, b, offs)``: 2-D x 3-D (tokens of each expert in turn: the MoE forward),
    2-D x 2-D (one weight gradient per group), 3-D x 2-D, or a plain batched matmul (3-D x 3-D)."""
    torch._check(a.dim() in (2, 3) and b.dim() in (2, 3),
                 lambda: f"grouped_mm: operands must be 2-D or 3-D, got {a.dim()}-D and {b.dim()}-D")
    torch._check(a.size(-1) == b.size(-2) or (a.dim() == 2 and b.dim() == 2),
                 lambda: f"grouped_mm: contraction sizes differ ({a.size(-1)} and {b.size(-2)})")
    groups = offs.size(0) if offs is not None else 0
    if a.dim() == 2 and b.dim() == 2:
        return [groups, a.size(0), b.size(1)]
    if a.dim() == 2:
        return [a.size(0), b.size(-1)]
    if b.dim() == 2:
        return [a.size(1), b.size(1)]
    return [a.size(0), a.size(1), b.size(-1)]


def _grouped_mm_fake(mode: FakeTensorMode, func, mat_a, mat_b, offs=None, bias=None, out_dtype=None) -> FakeTensor:
    """The fake kernel: the real kernel's dtype rule (equal dtypes out of :data:`DTYPES`) and its output."""
    torch._check(mat_a.dtype == mat_b.dtype and mat_a.dtype in DTYPES,
                 lambda: f"grouped_mm: operands must share one of {DTYPES}, got {mat_a.dtype} and {mat_b.dtype}")
    dtype = out_dtype or mat_a.dtype
    size = _out_size(mat_a, mat_b, offs)
    with in_kernel_invocation_manager(mode):
        out = torch.empty(size, dtype=dtype, device="meta")
    return FakeTensor(mode, out, mat_a.fake_device)


@contextlib.contextmanager
def grouped_mm_fake_kernel() -> Iterator[None]:
    """Within the block, fake tensors run ``aten._grouped_mm`` with :func:`_grouped_mm_fake` (see module doc).

    Registered in torch's table of fake implementations (``torch._subclasses.fake_impls``, consulted before the
    meta kernel) for the block only; an entry already there (a later torch's own) is left alone."""
    table = fake_impls.op_implementations_dict
    if GROUPED_MM in table:
        yield
        return
    table[GROUPED_MM] = _grouped_mm_fake
    try:
        yield
    finally:
        table.pop(GROUPED_MM, None)
