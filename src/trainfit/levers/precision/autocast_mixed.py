"""bf16-mixed / fp16-mixed: fp32 weights, autocast for forward + loss.

bf16 keeps fp32's exponent range, so no scaling. fp16 does not: small gradients
underflow, so it uses dynamic loss scaling. Autocast casts weights per op, so the
weights (and gradients and optimizer state) stay fp32: parameter memory does not halve.
"""

from __future__ import annotations

from trainfit.levers.precision.base import _Base


class AutocastMixed(_Base):
    """fp32 weights; forward + loss under ``torch.autocast`` in the row's dtype (all set by ``_Base``)."""
