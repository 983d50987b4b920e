"""bf16-mixed / fp16-mixed: fp32 weights, autocast for forward + loss.

bf16 keeps fp32's exponent range, so no scaling. fp16 does not: small gradients
underflow, so it uses dynamic loss scaling. Autocast casts weights per op, so the
weights (and gradients and optimizer state) stay fp32: parameter memory does not halve.
"""

from __future__ import annotations

import torch

from trainfit.levers.precision.base import _Base
from trainfit.levers.scaler import DynamicLossScaler, ScalerConfig


class AutocastMixed(_Base):
    def __init__(self, *, dtype: torch.dtype, scaler: ScalerConfig | None = None) -> None:
        super().__init__()
        assert dtype in (torch.bfloat16, torch.float16)
        self.autocast_dtype = dtype
        self.name = "bf16-mixed" if dtype == torch.bfloat16 else "fp16-mixed"
        if dtype == torch.float16:
            self.scaler = DynamicLossScaler(scaler)
