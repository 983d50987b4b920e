"""Trace attention (and the few other ops whose saved tensors differ by device) as the TARGET GPU runs them.

The memory estimator traces the step under ``FakeTensorMode`` on CPU tensors, so every op takes its CPU
path. For most ops the tensors autograd saves are the same on a GPU; for scaled-dot-product attention
they are not: the CPU dispatcher runs the math kernel whenever dropout is on (saving the sequence-squared
probabilities), while an H100 runs flash / cuDNN / memory-efficient kernels that keep only
``q, k, v, out`` + a log-sum-exp (+ an RNG seed) for backward. This module has

* a pure core, :func:`choose_sdpa_kernel`: the kernel PyTorch's CUDA dispatcher picks for a call on a
  target device, with the reason, from one fact table (:data:`ARCH`, :data:`RULES`), and
* a thin torch shell, :func:`target_kernels`: a ``TorchFunctionMode`` that routes each
  ``F.scaled_dot_product_attention`` call to the aten op of that kernel (their meta kernels run under
  fake CPU tensors and their autograd nodes save what ``derivatives.yaml`` says), applies CUDA's
  autocast policy where CPU's differs, runs training-mode dropout as CUDA's ``native_dropout``, and
  records every choice (:class:`KernelCall`) so the estimator can say what differs from the CPU trace.

Which rules, which torch. Read from PyTorch's ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``,
``sdp_utils_cpp.{h,cpp}`` and ``attention.cpp`` (main, 2026), checked against the 2.6-2.13 history:

* Priority: flash > memory-efficient > math (> cuDNN), the default order of torch 2.6-2.13, except on
  sm90 / sm100 where cuDNN goes first when the runtime cuDNN is newer than 9.15.0
  (``check_prefer_cudnn_attention``: pytorch#162073 for 2.9, gated on cuDNN > 9.15 by pytorch#171627; the
  wheels' bundled cuDNN crosses that line with torch 2.11, see huggingface/transformers#48163). So an
  H100/H200 with torch >= 2.11 runs cuDNN; cuDNN saves the same tensors as flash (lse ``(B, H, L, 1)``
  fp32 instead of ``(B, H, L)``), so the memory account is the same either way.
* Flash (sm80-sm121): fp16/bf16; q, k, v of one head_dim <= 256 (``attention.cpp`` pads it to a multiple
  of 8 and slices the output back); no ``attn_mask``; ``is_causal`` only with ``q_len == kv_len``; GQA
  with ``enable_gqa`` (heads divisible); on sm86-sm89 / sm120 (L4) a training call needs head_dim <= 192,
  or > 224 without dropout.
* Memory-efficient (sm50-sm121): fp32/fp16/bf16 on sm80+; head_dim a multiple of 8 (half) / 4 (fp32)
  (``minimum_gemm_alignment``), no upper bound; additive mask allowed (a bool mask becomes
  ``where(mask, 0, -inf)`` in the query dtype, padded to 8 columns, expanded); different q/kv heads NOT
  supported through 2.13 (pytorch#191085, July 2026, adds it; the 2.13 meta backward here rejects it), so
  GQA with a mask falls to math.
* cuDNN (sm80-sm121, preferred only as above): fp16/bf16; head_dim <= 128 and a multiple of 8 (256 needs
  cuDNN > 9.22, not assumed); dropout a multiple of 1/16; kv_len != 1; masks allowed; GQA allowed.
* Math: everything else. On CUDA its dropout is a bool mask (1 byte / element), so the shell passes one.

``cpu`` means "this machine's own dispatcher": :func:`target_kernels` leaves every call alone and the
rule for ``cpu`` (``sdp_utils_cpp``: the CPU flash kernel unless dropout > 0 or the dtype is not
fp32/fp64/bf16/fp16; masks and GQA allowed) only names what the CPU trace ran, for the comparison.

Other ops whose saved tensors differ by device, checked (the tests check the starred ones):

* dropout* -- YES. ``aten::dropout`` on CUDA is the fused ``native_dropout`` (saves a bool mask, 1 B /
  element); on CPU it is ``bernoulli_`` + ``mul`` (saves the noise in the input dtype: 4 B for fp32). The
  shell runs ``native_dropout`` for GPU targets. HF GPT-2 (resid/embd/attn pdrop 0.1) is the case.
* autocast policy* -- YES, partly. CUDA's autocast runs its "fp32 list" (``pow``, ``rsqrt``, ``exp``,
  ``log``, ``softmax``, ``log_softmax``, ``layer_norm``, ``group_norm``, ``sum``, ``cumsum``,
  ``logsumexp``, ``norm``, ``prod`` ...) in fp32 when given bf16/fp16; CPU autocast runs them in the
  input dtype (checked on torch 2.13: only the losses -- ``cross_entropy``, ``nll_loss``, ``mse_loss`` --
  go to fp32 on both). HF GPT-2's ``gelu_new`` (``torch.pow(x, 3.0)`` on a bf16 ``addmm`` output) thus
  saves fp32 tensors on CUDA and bf16 on CPU; the shell applies the CUDA fp32 rule to the ops in
  :data:`CUDA_FP32_OPS`. sdpa is in both devices' lower-precision list (handled: the kernel sees the
  autocast dtype). The built-in GPT and HF Llama feed these ops fp32 (residual stream, RMSNorm's explicit
  ``.float()``), so nothing changes for them.
* layer_norm -- no: ``native_layer_norm`` has a CPU and a CUDA kernel with the same saved set (input,
  weight, bias, mean and rstd of shape ``(N, 1)`` in the accumulation dtype).
* rms_norm -- not for our models: HF Llama's RMSNorm is Python (pow/mean/rsqrt, same on both); a model
  calling ``F.rms_norm`` gets the fused CUDA kernel (torch >= 2.8: saves rstd) vs the CPU composite --
  not handled, said here.
* cross_entropy / log_softmax -- no: ``log_softmax`` + ``nll_loss`` on both, saving the fp32
  log-probabilities (both autocast lists cast the loss to fp32).
* embedding backward -- no: both save the indices; the dense weight gradient is allocated in backward.
* optimizer* -- YES (temporaries, not saved tensors). ``torch.optim``'s ``_default_to_fused_or_foreach``
  picks foreach for CUDA tensors and the for-loop for CPU ones; foreach Adam/AdamW holds one temporary
  per parameter at once (``_foreach_sqrt`` of the second moment: one more copy of the parameters). With
  a large model and short activations that is the step's peak. :func:`target_kernels` registers a global
  optimizer step pre-hook that applies :func:`gpu_optimizer_defaults` (``foreach=True`` where unset).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode

from trainfit.errors import ConfigError
from trainfit.meters.devices import DEVICES
from trainfit.vocabulary import Dtype

FLASH, EFFICIENT, CUDNN, MATH, CPU_FLASH = "flash", "efficient", "cudnn", "math", "cpu-flash"
KERNELS = (FLASH, EFFICIENT, CUDNN, MATH, CPU_FLASH)
FP32, BF16, FP16, FP64 = Dtype.FP32.value, Dtype.BF16.value, Dtype.FP16.value, "fp64"
DTYPE_NAMES = (FP32, FP64, BF16, FP16)


@dataclass(frozen=True, kw_only=True)
class Arch:
    """One target's compute capability (what the SDPA rules branch on)."""

    sm: tuple[int, int]
    """CUDA compute capability (major, minor)."""
    source: str


ARCH: dict[str, Arch] = {
    "h100": Arch(sm=(9, 0), source="NVIDIA CUDA GPUs compute capability table: H100 = 9.0"),
    "h200": Arch(sm=(9, 0), source="NVIDIA CUDA GPUs compute capability table: H200 = 9.0 (Hopper)"),
    "a100": Arch(sm=(8, 0), source="NVIDIA CUDA GPUs compute capability table: A100 = 8.0"),
    "l4": Arch(sm=(8, 9), source="NVIDIA CUDA GPUs compute capability table: L4 = 8.9 (Ada)"),
    "a100-40gb": Arch(sm=(8, 0), source="NVIDIA CUDA GPUs compute capability table: A100 = 8.0"),
    "a100-pcie": Arch(sm=(8, 0), source="NVIDIA CUDA GPUs compute capability table: A100 = 8.0"),
    "a100-pcie-40gb": Arch(sm=(8, 0), source="NVIDIA CUDA GPUs compute capability table: A100 = 8.0"),
    "h100-pcie": Arch(sm=(9, 0), source="NVIDIA CUDA GPUs compute capability table: H100 = 9.0"),
    "l40s": Arch(sm=(8, 9), source="NVIDIA CUDA GPUs compute capability table: L40S = 8.9 (Ada)"),
}
"""The GPU targets of ``meters.devices.DEVICES``; ``cpu`` has no row (its own dispatcher decides)."""

RULES: tuple[tuple[str, str, str], ...] = (
    ("priority", "flash > efficient > math; cuDNN first on sm90/sm100 from torch 2.11 (cuDNN > 9.15)",
     "sdp_utils.cpp priority_order/check_prefer_cudnn_attention; pytorch#162073, #171627; transformers#48163"),
    ("flash", "fp16/bf16, head_dim <= 256 (padded to 8), no mask, causal needs q_len == kv_len, GQA ok; "
              "sm86-89 training: head_dim <= 192 or (> 224 and no dropout)",
     "sdp_utils.cpp can_use_flash_attention; attention.cpp pad_last_dim<8>"),
    ("efficient", "fp32/fp16/bf16 (sm80+), head_dim % 8 (half) or % 4 (fp32), mask ok, no GQA (<= 2.13)",
     "sdp_utils.cpp can_use_mem_efficient_attention, minimum_gemm_alignment; pytorch#191085"),
    ("cudnn", "fp16/bf16, head_dim <= 128 and % 8, dropout a multiple of 1/16, kv_len != 1, mask ok, GQA ok",
     "sdp_utils.cpp can_use_cudnn_attention, check_cudnn_tensor_shapes, check_cudnn_dropout"),
    ("cpu", "CPU flash unless dropout > 0 or dtype not fp32/fp64/bf16/fp16; masks and GQA ok",
     "sdp_utils_cpp.cpp use_flash_attention_cpp"),
)
"""The rules :func:`choose_sdpa_kernel` follows, one row each: (kernel, rule, source)."""


@dataclass(frozen=True, kw_only=True)
class KernelChoice:
    name: str
    """One of :data:`KERNELS`."""
    reason: str
    """Why this kernel (and why not the ones before it in the priority order)."""


def _flash_refusal(sm: tuple[int, int], *, dtype: str, head_dim: int, v_head_dim: int, has_attn_mask: bool,
                   dropout_p: float, is_causal: bool, q_len: int, kv_len: int, requires_grad: bool,
                   heads_ok: bool) -> str | None:
    if dtype not in (FP16, BF16):
        return f"flash needs fp16/bf16, got {dtype}"
    if has_attn_mask:
        return "flash takes no attn_mask"
    if head_dim != v_head_dim or head_dim > 256:
        return f"flash needs one head_dim <= 256, got {head_dim}/{v_head_dim}"
    if is_causal and q_len != kv_len:
        return f"flash's is_causal needs q_len == kv_len, got {q_len}/{kv_len}"
    if not heads_ok:
        return "flash needs equal heads, or enable_gqa with divisible heads"
    if requires_grad and ((8, 6) <= sm <= (8, 9) or (12, 0) <= sm <= (12, 1)):
        if not (head_dim <= 192 or (head_dim > 224 and dropout_p == 0.0)):
            return f"flash backward on sm{sm[0]}{sm[1]} needs head_dim <= 192 (or > 224 without dropout)"
    return None


def _efficient_refusal(*, dtype: str, head_dim: int, v_head_dim: int, same_heads: bool) -> str | None:
    if dtype not in (FP32, FP16, BF16):
        return f"efficient needs fp32/fp16/bf16, got {dtype}"
    align = 4 if dtype == FP32 else 8
    if head_dim % align or v_head_dim % align:
        return f"efficient needs head_dim a multiple of {align} for {dtype}, got {head_dim}/{v_head_dim}"
    if not same_heads:
        return "efficient needs equal q/kv heads through torch 2.13 (GQA goes to math)"
    return None


def _cudnn_refusal(*, dtype: str, head_dim: int, v_head_dim: int, dropout_p: float, kv_len: int,
                   heads_ok: bool) -> str | None:
    if dtype not in (FP16, BF16):
        return f"cuDNN needs fp16/bf16, got {dtype}"
    if head_dim > 128 or v_head_dim > 128 or head_dim % 8 or v_head_dim % 8:
        return f"cuDNN needs head_dim <= 128 and a multiple of 8, got {head_dim}/{v_head_dim}"
    if dropout_p * 16 != math.floor(dropout_p * 16):
        return f"cuDNN dropout must be a multiple of 1/16, got {dropout_p}"
    if kv_len == 1:
        return "cuDNN needs kv_len > 1"
    if not heads_ok:
        return "cuDNN needs divisible heads"
    return None


def choose_sdpa_kernel(target: str, *, dtype: str, head_dim: int, has_attn_mask: bool, mask_requires_grad: bool,
                       dropout_p: float, is_causal: bool, enable_gqa: bool, q_len: int, kv_len: int,
                       requires_grad: bool, num_heads: int = 1, num_kv_heads: int | None = None,
                       v_head_dim: int | None = None, torch_version: tuple[int, int] = (2, 11)) -> KernelChoice:
    """The SDPA kernel PyTorch's dispatcher runs for one call on ``target`` (rules: module docstring).

    Args:
        target: a ``meters.devices.DEVICES`` name (h100, h200, a100, l4, cpu).
        dtype: the dtype q/k/v reach the kernel in (after autocast): fp32, fp64, bf16 or fp16.
        head_dim, v_head_dim: last dim of q/k and of v (v defaults to head_dim).
        has_attn_mask: an explicit ``attn_mask`` is passed (bool or additive).
        mask_requires_grad: the mask needs a gradient; no kernel's choice depends on it in the versions
            read (efficient and cuDNN save the bias either way), kept so the record says it.
        dropout_p, is_causal, enable_gqa, q_len, kv_len: as passed to sdpa.
        requires_grad: q/k/v need gradients and grad mode is on (training).
        num_heads, num_kv_heads: q heads and k/v heads (kv defaults to q).
        torch_version: (major, minor) of the torch the target runs (decides cuDNN's priority).
    Returns:
        The :class:`KernelChoice`.
    Raises:
        ConfigError: an unknown target or dtype.
    """
    if target not in DEVICES:
        raise ConfigError("device", target, tuple(DEVICES), "add a row to trainfit.meters.devices.DEVICES")
    if dtype not in DTYPE_NAMES:
        raise ConfigError("dtype", dtype, DTYPE_NAMES)
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    same_heads = num_heads == num_kv_heads
    heads_ok = same_heads or (enable_gqa and num_kv_heads > 0 and num_heads % num_kv_heads == 0)
    mask_note = " (mask requires grad)" if has_attn_mask and mask_requires_grad else ""
    if target == "cpu":
        if dropout_p > 0.0:
            return KernelChoice(name=MATH, reason=f"CPU flash takes no dropout (dropout_p={dropout_p})")
        return KernelChoice(name=CPU_FLASH, reason="CPU flash: no dropout, dtype " + dtype + mask_note)
    if target not in ARCH:
        raise ConfigError("device", target, tuple(ARCH) + ("cpu",), "add a row to trainfit.meters.attention.ARCH")
    sm = ARCH[target].sm
    refusals: list[str] = []
    prefer_cudnn = (sm[0] == 9 and sm[1] == 0 or sm[0] == 10) and torch_version >= (2, 11)
    if prefer_cudnn:
        why = _cudnn_refusal(dtype=dtype, head_dim=head_dim, v_head_dim=v_head_dim, dropout_p=dropout_p,
                             kv_len=kv_len, heads_ok=heads_ok)
        if why is None:
            return KernelChoice(name=CUDNN, reason=f"cuDNN first on sm{sm[0]}{sm[1]} with torch >= 2.11; "
                                                   f"{dtype}, head_dim {head_dim}{mask_note}")
        refusals.append(why)
    why = _flash_refusal(sm, dtype=dtype, head_dim=head_dim, v_head_dim=v_head_dim, has_attn_mask=has_attn_mask,
                         dropout_p=dropout_p, is_causal=is_causal, q_len=q_len, kv_len=kv_len,
                         requires_grad=requires_grad, heads_ok=heads_ok)
    if why is None:
        return KernelChoice(name=FLASH, reason="; ".join(refusals + [f"flash: {dtype}, head_dim {head_dim}, no mask"]))
    refusals.append(why)
    why = _efficient_refusal(dtype=dtype, head_dim=head_dim, v_head_dim=v_head_dim, same_heads=same_heads)
    if why is None:
        return KernelChoice(name=EFFICIENT, reason="; ".join(refusals) + mask_note)
    refusals.append(why)
    return KernelChoice(name=MATH, reason="; ".join(refusals))


def fused_saved_bytes(kernel: str, *, batch: int, num_heads: int, num_kv_heads: int, q_len: int, kv_len: int,
                      head_dim: int, v_head_dim: int | None = None, dtype_bytes: int, mask_bytes: int = 0) -> int:
    """Bytes one fused sdpa call keeps for backward (q, k, v as separate storages), for the planner's basis.

    flash: q, k, v, out + logsumexp fp32 ``(B, H, L)`` + rng state (two uint64 words + one unused uint64);
    cuDNN: the same with logsumexp ``(B, H, L, 1)`` and an int64 seed + offset; efficient: logsumexp
    ``(B, H, ceil(L/32)*32)`` fp32, an int64 seed + offset, and the bias it was given (``mask_bytes``).
    Linear in L and S: no sequence-squared term (math keeps one: trace it). Flash's head_dim is padded
    to a multiple of 8 as ``attention.cpp`` does.

    Raises:
        ConfigError: a kernel other than flash, cudnn or efficient.
    """
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    if kernel == FLASH:
        head_dim, v_head_dim = -(-head_dim // 8) * 8, -(-v_head_dim // 8) * 8
    qkv = batch * (num_heads * q_len * head_dim + num_kv_heads * kv_len * (head_dim + v_head_dim)) * dtype_bytes
    out = batch * num_heads * q_len * v_head_dim * dtype_bytes
    if kernel == FLASH:
        return qkv + out + batch * num_heads * q_len * 4 + 3 * 8
    if kernel == CUDNN:
        return qkv + out + batch * num_heads * q_len * 4 + 2 * 8 + mask_bytes
    if kernel == EFFICIENT:
        return qkv + out + batch * num_heads * (-(-q_len // 32) * 32) * 4 + 2 * 8 + mask_bytes
    raise ConfigError("kernel", kernel, (FLASH, CUDNN, EFFICIENT), "math keeps (B, H, L, S) tensors: trace it")


# ---------------------------------------------------------------------------------------------- torch shell

_DTYPE_NAME = {torch.float32: FP32, torch.float64: FP64, torch.bfloat16: BF16, torch.float16: FP16}

CUDA_FP32_OPS = frozenset({
    torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.Tensor.__rpow__, torch.rsqrt, torch.Tensor.rsqrt,
    torch.exp, torch.Tensor.exp, torch.log, torch.Tensor.log, torch.log1p, torch.Tensor.log1p,
    torch.expm1, torch.Tensor.expm1, torch.reciprocal, torch.Tensor.reciprocal,
    F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
    F.layer_norm, torch.layer_norm, F.group_norm, torch.group_norm,
    torch.sum, torch.Tensor.sum, torch.cumsum, torch.Tensor.cumsum, torch.prod, torch.Tensor.prod,
    torch.logsumexp, torch.Tensor.logsumexp, torch.norm, torch.Tensor.norm,
})
"""Ops CUDA autocast runs in fp32 that CPU autocast runs in the input dtype (torch/amp "CUDA Ops that can
autocast to float32" minus what CPU autocast also casts, checked on torch 2.13); only out-of-place calls
without an explicit ``dtype=`` are eligible, as in autocast itself."""


@dataclass(frozen=True, kw_only=True)
class KernelCall:
    """One sdpa call as the target runs it, next to what the CPU trace would have run."""

    kernel: str
    reason: str
    cpu_kernel: str
    cpu_reason: str
    dtype: str
    q_shape: tuple[int, ...]
    kv_shape: tuple[int, ...]
    dropout_p: float
    has_attn_mask: bool


@dataclass(kw_only=True)
class TargetRecord:
    """What :func:`target_kernels` changed: every sdpa call, and the other ops it re-routed."""

    target: str
    calls: list[KernelCall] = field(default_factory=list)
    dropouts: int = 0
    """Training-mode dropouts run as CUDA's ``native_dropout`` (bool mask saved)."""
    fp32_casts: int = 0
    """Calls given fp32 inputs by the CUDA autocast rule (:data:`CUDA_FP32_OPS`)."""
    unpacked_assumed: int = 0
    """transformers mask builds where fake ``position_ids`` were taken as one unpacked sequence each."""
    foreach_groups: int = 0
    """Optimizer parameter groups switched to foreach (the CUDA default) at their first step."""

    def lines(self) -> list[str]:
        """One line per distinct difference from the CPU trace, with counts (what the estimator prints)."""
        out: dict[str, int] = {}
        for c in self.calls:
            if c.kernel == c.cpu_kernel:
                key = f"attention: {c.kernel} as on CPU ({c.dtype}, q {c.q_shape})"
            else:
                key = (f"attention: {self.target} runs {c.kernel} ({c.reason}) where the CPU trace ran "
                       f"{c.cpu_kernel} ({c.cpu_reason}); q {c.q_shape} {c.dtype}")
            out[key] = out.get(key, 0) + 1
        lines = [f"{k} x{n}" for k, n in out.items()]
        if self.dropouts:
            lines.append(f"dropout: {self.dropouts} calls run as CUDA's fused native_dropout (bool mask, 1 B/element) "
                         "where CPU saves the noise in the input dtype")
        if self.fp32_casts:
            lines.append(f"autocast: {self.fp32_casts} calls (pow, softmax, layer_norm, ...) in fp32 as CUDA "
                         "autocast runs them, where CPU autocast keeps bf16/fp16")
        if self.foreach_groups:
            lines.append(f"optimizer: {self.foreach_groups} parameter groups step with foreach (the CUDA default: "
                         "temporaries for all parameters at once) instead of the CPU for-loop")
        if self.unpacked_assumed:
            lines.append(f"transformers masks: {self.unpacked_assumed} builds took the fake position_ids as unpacked "
                         "sequences (is_causal, no mask tensor), as a real run with contiguous positions does")
        return lines


def _autocast_dtype() -> torch.dtype | None:
    """The lower-precision dtype of the active CPU autocast region (the trace runs on CPU), else None."""
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return None


def _pad8(t: torch.Tensor) -> torch.Tensor:
    pad = (-t.shape[-1]) % 8
    return F.pad(t, (0, pad)) if pad else t


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the additive bias torch builds (``where(mask, 0, -inf)`` in the query dtype)."""
    if mask.dtype == torch.bool:
        return torch.where(mask, torch.zeros((), dtype=dtype), torch.full((), -math.inf, dtype=dtype))
    return mask


def _efficient_bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``attention.cpp`` preprocess_mask: pad to 8 columns unless aligned, then expand to (B, H, L, S)."""
    aligned = mask.stride(-1) == 1 and all(s % 8 == 0 for s in mask.stride()[:-1])
    if not aligned:
        n = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - n % 8))[..., :n]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _sdpa_args(args: tuple, kwargs: dict) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    got = dict(zip(names, args, strict=False))
    got.update(kwargs)
    return {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False, **got}


class _TargetMode(TorchFunctionMode):
    def __init__(self, record: TargetRecord, torch_version: tuple[int, int]) -> None:
        super().__init__()
        self.record = record
        self.torch_version = torch_version

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._sdpa(**_sdpa_args(args, kwargs))
        if func is F.dropout:
            return self._dropout(func, args, kwargs)
        if func in CUDA_FP32_OPS and "dtype" not in kwargs and "out" not in kwargs:
            low = _autocast_dtype()
            if low is not None and any(isinstance(a, torch.Tensor) and a.dtype == low for a in args):
                self.record.fp32_casts += 1
                args = tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype == low else a for a in args)
        return func(*args, **kwargs)

    def _dropout(self, func, args, kwargs):
        x = args[0]
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        training = args[2] if len(args) > 2 else kwargs.get("training", True)
        inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
        if not training or inplace or not 0.0 < p < 1.0 or x.numel() == 0:
            return func(*args, **kwargs)
        self.record.dropouts += 1
        return torch.ops.aten.native_dropout(x, p, True)[0]

    def _sdpa(self, *, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        low = _autocast_dtype()
        if low is not None:  # sdpa is in CUDA autocast's lower-precision list: every floating arg is cast
            query, key, value = (t.to(low) if t.is_floating_point() else t for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(low)
        q_len, kv_len, d = query.shape[-2], key.shape[-2], query.shape[-1]
        requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        facts = dict(dtype=_DTYPE_NAME.get(query.dtype, str(query.dtype)), head_dim=d, v_head_dim=value.shape[-1],
                     has_attn_mask=attn_mask is not None,
                     mask_requires_grad=bool(attn_mask is not None and attn_mask.requires_grad),
                     dropout_p=float(dropout_p), is_causal=bool(is_causal), enable_gqa=bool(enable_gqa),
                     q_len=q_len, kv_len=kv_len, requires_grad=requires_grad,
                     num_heads=query.shape[-3] if query.dim() >= 3 else 1,
                     num_kv_heads=key.shape[-3] if key.dim() >= 3 else 1)
        if query.dim() != 4:  # the fused kernels take (B, H, L, D) only
            choice = KernelChoice(name=MATH, reason=f"fused kernels need 4-D q/k/v, got {query.dim()}-D")
        else:
            choice = choose_sdpa_kernel(self.record.target, torch_version=self.torch_version, **facts)
        cpu = choose_sdpa_kernel("cpu", **facts)
        self.record.calls.append(KernelCall(kernel=choice.name, reason=choice.reason, cpu_kernel=cpu.name,
                                            cpu_reason=cpu.reason, dtype=facts["dtype"], q_shape=tuple(query.shape),
                                            kv_shape=tuple(key.shape), dropout_p=float(dropout_p),
                                            has_attn_mask=attn_mask is not None))
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        aten = torch.ops.aten
        with torch.autocast("cpu", enabled=False):
            if choice.name == FLASH:
                out = aten._scaled_dot_product_flash_attention(_pad8(query), _pad8(key), _pad8(value), dropout_p,
                                                               is_causal, False, scale=scale)[0]
                return out[..., :value.shape[-1]] if out.shape[-1] != value.shape[-1] else out
            mask = None if attn_mask is None else _additive(attn_mask, query.dtype)
            if choice.name == CUDNN:
                return aten._scaled_dot_product_cudnn_attention(query, key, value, mask, requires_grad, dropout_p,
                                                                is_causal, False, scale=scale)[0]
            if choice.name == EFFICIENT:
                bias = None if mask is None else _efficient_bias(mask, query, key)
                return aten._scaled_dot_product_efficient_attention(query, key, value, bias, requires_grad,
                                                                    dropout_p, is_causal, scale=scale)[0]
            drop_mask = None
            if dropout_p > 0.0:  # CUDA's math path drops with a bool mask (native_dropout)
                shape = (*query.shape[:-1], key.shape[-2])
                drop_mask = torch.empty(shape, dtype=torch.bool, device=query.device).bernoulli_(1 - dropout_p)
            return aten._scaled_dot_product_attention_math(query, key, value, mask, dropout_p, is_causal,
                                                           drop_mask, scale=scale, enable_gqa=bool(enable_gqa))[0]


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@contextlib.contextmanager
def target_kernels(target: str, *, torch_version: tuple[int, int] | None = None) -> Iterator[TargetRecord]:
    """Within the block, sdpa, dropout and CUDA's fp32-autocast ops run as on ``target`` (see module doc).

    Args:
        target: a ``meters.devices.DEVICES`` name; ``cpu`` changes nothing (the record stays empty).
        torch_version: the target's torch (major, minor); default: this machine's.
    Yields:
        The :class:`TargetRecord`, filled as the block runs.
    Raises:
        ConfigError: an unknown target.
    """
    if target not in DEVICES:
        raise ConfigError("device", target, tuple(DEVICES), "add a row to trainfit.meters.devices.DEVICES")
    record = TargetRecord(target=target)
    if target == "cpu":
        yield record
        return
    def foreach_default(optimizer, args, kwargs):
        record.foreach_groups += len(gpu_optimizer_defaults(optimizer))

    # a global step pre-hook (public torch.optim API): the optimizer is built inside the traced run
    handle = register_optimizer_step_pre_hook(foreach_default)
    mode = _TargetMode(record, torch_version or _torch_version())
    _ACTIVE.append(mode)
    try:
        with _hf_unpacked_positions(record), mode:
            yield record
    finally:
        _ACTIVE.remove(mode)
        handle.remove()


_ACTIVE: list[TorchFunctionMode] = []
"""The target modes entered (innermost last): activation checkpointing re-enters one in its recompute."""


def recompute_context() -> contextlib.AbstractContextManager:
    """What a checkpoint's recompute must run under to see the target's kernels again.

    Autograd runs the recompute with no torch-function mode on the stack (checked on torch 2.13: a mode entered
    around the forward is gone inside backward), so the forward would save the target kernel's tensors and the
    recompute the CPU's -- which the checkpoint refuses. ``levers.checkpointing`` enters this around every
    recompute: the innermost :func:`target_kernels` mode when one is active and not on the stack, else nothing."""
    if _ACTIVE and torch._C._len_torch_function_stack() == 0:
        return _ACTIVE[-1]
    return contextlib.nullcontext()


@contextlib.contextmanager
def _hf_unpacked_positions(record: TargetRecord) -> Iterator[None]:
    """Take fake ``position_ids`` as unpacked in transformers' mask builder (only if transformers is loaded).

    Without a KV cache (training: ``use_cache=False``), ``masking_utils.create_causal_mask`` asks
    ``find_packed_sequence_indices(position_ids)`` whether the batch packs several sequences; it cannot read a
    fake tensor, so it answers "maybe", and the mask is built as a (B, 1, S, S) tensor. A real run with
    contiguous positions passes no mask and ``is_causal=True`` -- the flash / cuDNN kernels' case. The
    estimator's batches are unpacked, so a fake tensor is answered "not packed" and the answer counted.
    """
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def unpacked(position_ids, *args, **kwargs):
        if isinstance(position_ids, FakeTensor):
            record.unpacked_assumed += 1
            return None
        return original(position_ids, *args, **kwargs)

    masking.find_packed_sequence_indices = unpacked
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def gpu_optimizer_defaults(optimizer: torch.optim.Optimizer) -> list[str]:
    """Make ``optimizer`` take the CUDA default implementation (foreach) where the user left it unset.

    ``torch.optim`` decides at step time (``_default_to_fused_or_foreach``): foreach for CUDA tensors, the
    per-parameter loop for CPU ones. Foreach kernels also run on CPU tensors, so the fake CPU trace then
    holds the temporaries a GPU step holds. Returns one note per changed parameter group.
    """
    notes = []
    for i, group in enumerate(optimizer.param_groups):
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True
            notes.append(f"optimizer group {i}: foreach (the CUDA default) instead of the CPU for-loop")
    return notes


def hf_attention_note(model: Any, target: str = "h100") -> str:
    """What attention a ``transformers`` model uses, and what a run on ``target`` would use.

    ``transformers`` fixes ``config._attn_implementation`` at load time: "sdpa" by default wherever torch
    has it (CPU and GPU alike); "flash_attention_2" needs the flash-attn package and is never a default;
    "eager" writes the softmax in Python (probabilities saved on every device).
    """
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None) if config is not None else None
    if impl is None:
        return "not a transformers model: its attention calls are traced as written"
    if impl == "sdpa":
        on = "the CPU dispatcher's kernel" if target == "cpu" else f"{target}'s SDPA kernel (flash/cuDNN/efficient/math)"
        return f"attn_implementation='sdpa' (the default, same on CPU and GPU): traced with {on}"
    if impl == "eager":
        return "attn_implementation='eager': softmax in Python, probabilities saved on any device"
    return (f"attn_implementation={impl!r}: not sdpa, traced as this machine runs it; a GPU run would use "
            f"{impl} only if its package is installed there")
