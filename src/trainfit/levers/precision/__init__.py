"""Precision policies behind one protocol (:class:`~trainfit.levers.precision.base.Precision`).

==============  ==================  ============  ==========================================
name            weights stored in   autocast      loss scaling / master copy
==============  ==================  ============  ==========================================
fp32            fp32                no            none
bf16-mixed      fp32                bf16          none (bf16 has fp32's exponent range)
fp16-mixed      fp32                fp16          dynamic loss scaling
bf16-true       bf16                no            fp32 master copy for the optimizer
fp16-true       fp16                no            fp32 master copy + dynamic loss scaling
==============  ==================  ============  ==========================================
"""

from __future__ import annotations

import torch

from trainfit.errors import ConfigError
from trainfit.levers.precision.autocast_mixed import AutocastMixed
from trainfit.levers.precision.base import Precision
from trainfit.levers.precision.fp32 import FP32
from trainfit.levers.precision.half_master import HalfWithMaster
from trainfit.levers.scaler import ScalerConfig

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true")


def make_precision(name: str, *, scaler: ScalerConfig | None = None) -> Precision:
    """Build a fresh precision policy by name (one per model/optimizer pair)."""
    if name == "fp32":
        return FP32()
    if name == "bf16-mixed":
        return AutocastMixed(dtype=torch.bfloat16)
    if name == "fp16-mixed":
        return AutocastMixed(dtype=torch.float16, scaler=scaler)
    if name == "bf16-true":
        return HalfWithMaster(dtype=torch.bfloat16)
    if name == "fp16-true":
        return HalfWithMaster(dtype=torch.float16, scaler=scaler)
    raise ConfigError("precision", name, PRECISIONS)


__all__ = ["PRECISIONS", "Precision", "make_precision", "FP32", "AutocastMixed", "HalfWithMaster"]
