"""Precision policies behind one protocol (:class:`~trainfit.levers.precision.base.Precision`).

Which policy a name builds follows from its row in :data:`trainfit.vocabulary.PRECISIONS`
(weights dtype, autocast dtype, master copy, loss scaling):

==============  ==================  ============  ==========================================
row             weights stored in   autocast      loss scaling / master copy
==============  ==================  ============  ==========================================
FP32            fp32                no            none
BF16_MIXED      fp32                bf16          none (bf16 has fp32's exponent range)
FP16_MIXED      fp32                fp16          dynamic loss scaling
BF16_TRUE       bf16                no            fp32 master copy for the optimizer
FP16_TRUE       fp16                no            fp32 master copy + dynamic loss scaling
==============  ==================  ============  ==========================================
"""

from __future__ import annotations

from trainfit.errors import ConfigError
from trainfit.levers.precision.autocast_mixed import AutocastMixed
from trainfit.levers.precision.base import Precision
from trainfit.levers.precision.fp32 import FP32
from trainfit.levers.precision.half_master import HalfWithMaster
from trainfit.levers.scaler import ScalerConfig
from trainfit.vocabulary import PRECISIONS, PrecisionName


def make_precision(name: str, *, scaler: ScalerConfig | None = None) -> Precision:
    """Build a fresh precision policy by name (one per model/optimizer pair), from its vocabulary row."""
    if name not in PRECISIONS:
        raise ConfigError("precision", name, tuple(PRECISIONS))
    facts = PRECISIONS[PrecisionName(name)]
    if facts.master_copy:
        return HalfWithMaster(facts, scaler=scaler)
    if facts.autocast:
        return AutocastMixed(facts, scaler=scaler)
    return FP32(facts)


__all__ = ["PRECISIONS", "Precision", "make_precision", "FP32", "AutocastMixed", "HalfWithMaster"]
