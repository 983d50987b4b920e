"""FLOPs of a training step, counted on the real model with ``FlopCounterMode``.

Model FLOPs (for MFU) are forward + backward without recompute; hardware FLOPs (for HFU)
add the forward that activation checkpointing re-runs in backward. Both are counted, not
derived from a transformer formula, by running one forward + backward of the model under
``torch.utils.flop_counter.FlopCounterMode`` -- once built plainly and once with the run's
checkpointing policy. The copies are built on the ``meta`` device (shapes only: no memory,
no arithmetic); a model that cannot run on meta is counted on CPU instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
import torch.utils.flop_counter as flop_counter_formulas
from torch.utils.flop_counter import FlopCounterMode

from trainfit.tasks.base import to_device

_aten = torch.ops.aten


def _cpu_attention(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter_formulas.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                            **kwargs) -> int:
    return flop_counter_formulas.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _grouped_mm(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``aten._grouped_mm``, the MoE experts' matmul: every row of the ragged operand meets one group's matrix, so
    the FLOPs are one plain matmul's over all rows -- 2-D x 3-D (tokens x experts' weights, the forward and the
    input gradient): 2 T K N; 2-D x 2-D (the weight gradient, K x T by T x N split into groups): 2 K T N; 3-D x 2-D:
    2 M K N; 3-D x 3-D: a batched matmul."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 2:
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]


CPU_ATTENTION_FLOPS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
    _aten._grouped_mm: _grouped_mm,
}
"""The CPU's fused attention kernel, which ``FlopCounterMode``'s table leaves out (it has the CUDA ones): the
same FLOPs as the flash kernel (QK^T and PV forward, their four matmuls backward), counted alike. And the MoE
experts' grouped matmul (:func:`_grouped_mm`), which the table leaves out on every device (torch 2.13)."""


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also counts the CPU's fused attention."""
    return FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)


def count_flops(model: nn.Module, loss_fn: Callable, batch) -> int:
    """FLOPs of one forward + loss + backward of ``model`` on ``batch`` (as the model runs it)."""
    with flop_counter() as counter:
        loss_sum, _ = loss_fn(model, batch)
        loss_sum.backward()
    return int(counter.get_total_flops())


@dataclass(frozen=True, kw_only=True)
class StepFlops:
    model_flops: int
    """Forward + backward FLOPs per step, recompute excluded (the numerator of MFU)."""
    hardware_flops: int
    """FLOPs actually executed per step, recompute included (the numerator of HFU)."""
    counted_on: str
    """"meta" or "cpu": where the counting copy of the model ran."""


def _shape_key(batch) -> tuple:
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape), batch.dtype)
    if isinstance(batch, dict):
        return tuple((k, _shape_key(v)) for k, v in sorted(batch.items()))
    if isinstance(batch, (list, tuple)):
        return tuple(_shape_key(v) for v in batch)
    return (repr(batch),)


class FlopCounter:
    """Counts per-micro-batch FLOPs of a task's model, cached by the batch's shapes.

    Args:
        build_model: the task's model factory (called on the meta device, or CPU as a fallback).
        loss_fn: the task's ``loss(model, batch)``.
        recompute: applies the run's activation checkpointing to a fresh model, in place (None: the
            run recomputes nothing, hardware FLOPs = model FLOPs). A meter knows no lever: the probe
            hands it the lever's effect.
        max_counts: distinct batch shapes to count at most (each count runs the model once on
            meta, ~0.1-0.5 s for a small model on a loaded CPU); steps needing more are not counted.
    """

    def __init__(self, *, build_model: Callable[[], nn.Module], loss_fn: Callable,
                 recompute: Callable[[nn.Module], object] | None = None, max_counts: int = 8) -> None:
        self.build_model, self.loss_fn, self.recompute = build_model, loss_fn, recompute
        self.max_counts = max_counts
        self.device = torch.device("meta")
        self._models: dict[bool, nn.Module] = {}
        self._cache: dict[tuple, tuple[int, int]] = {}

    def _model(self, checkpointed: bool) -> nn.Module:
        if checkpointed not in self._models:
            with self.device:
                m = self.build_model()
            m.train()
            if checkpointed:
                self.recompute(m)
            self._models[checkpointed] = m
        return self._models[checkpointed]

    def _count(self, batch) -> tuple[int, int]:
        b = to_device(batch, self.device)
        model_flops = count_flops(self._model(False), self.loss_fn, b)
        if self.recompute is None:
            return model_flops, model_flops
        return model_flops, count_flops(self._model(True), self.loss_fn, b)

    def micro_batch(self, batch) -> tuple[int, int]:
        """(model FLOPs, hardware FLOPs) of one micro-batch."""
        key = _shape_key(batch)
        if key not in self._cache:
            try:
                self._cache[key] = self._count(batch)
            except (NotImplementedError, RuntimeError):
                if self.device.type != "meta":
                    raise
                # Data-dependent ops (e.g. .item()) cannot run on meta: count on a real CPU copy.
                self.device, self._models = torch.device("cpu"), {}
                self._cache[key] = self._count(batch)
        return self._cache[key]

    def step(self, micro_batches: list) -> StepFlops | None:
        """FLOPs of one optimizer step over ``micro_batches``; None when new shapes would exceed
        ``max_counts`` (never for the first step counted)."""
        new = {_shape_key(mb) for mb in micro_batches} - set(self._cache)
        if self._cache and len(self._cache) + len(new) > self.max_counts:  # the first step always counts
            return None
        counts = [self.micro_batch(mb) for mb in micro_batches]
        return StepFlops(model_flops=sum(c[0] for c in counts), hardware_flops=sum(c[1] for c in counts),
                         counted_on=self.device.type)
