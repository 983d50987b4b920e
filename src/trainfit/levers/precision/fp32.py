"""fp32: the reference. No autocast, no scaling."""

from trainfit.levers.precision.base import _Base


class FP32(_Base):
    """No autocast, no scaling: every tensor fp32."""
