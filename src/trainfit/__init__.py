"""trainfit: make a PyTorch training run fit in memory and scale -- measuring first."""

from trainfit.engine import StepResult, optimizer_step
from trainfit.levers.checkpointing import apply_checkpointing, parse_checkpoint_policy
from trainfit.levers.precision import make_precision

__version__ = "0.1.0"
__all__ = ["optimizer_step", "StepResult", "make_precision", "apply_checkpointing", "parse_checkpoint_policy"]
