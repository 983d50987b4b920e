"""fp32: the reference. No autocast, no scaling."""

from trainfit.levers.precision.base import _Base


class FP32(_Base):
    name = "fp32"
