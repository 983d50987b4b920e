"""Dynamic loss scaling as an explicit state machine.

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by
a large scale S moves them into range; gradients are divided by S ("unscaled") before
clipping and the optimizer; a step whose gradients overflowed (inf/NaN) is skipped and
S is halved; after ``growth_interval`` clean steps in a row S is doubled.

Pure core: :class:`ScaleState` and :func:`next_scale_state` (no torch). Torch shell:
:class:`DynamicLossScaler`, whose calls must come in the order
``scale_loss* -> unscale_ -> update`` (READY -> UNSCALED -> READY); out-of-order calls raise.
The same arithmetic as ``torch.amp.GradScaler`` (tested against it), plus an optional
all-reduce of the overflow flag so every rank skips the same steps.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from trainfit.errors import ConfigError

AllReduceMax = Callable[[torch.Tensor], None]
"""In-place all-reduce(MAX) of a one-element tensor; supplied by the strategy."""


@dataclass(frozen=True, kw_only=True)
class ScalerConfig:
    init_scale: float = 2.0**16
    """Starting scale (GradScaler's default)."""
    growth_factor: float = 2.0
    """Multiply the scale by this after ``growth_interval`` clean steps in a row."""
    backoff_factor: float = 0.5
    """Multiply the scale by this on any inf/NaN gradient."""
    growth_interval: int = 2000
    """Clean steps in a row before growing the scale."""

    def __post_init__(self) -> None:
        if not self.init_scale > 0:
            raise ConfigError("init_scale", self.init_scale, "a number > 0")
        if not self.growth_factor > 1:
            raise ConfigError("growth_factor", self.growth_factor, "a number > 1")
        if not 0 < self.backoff_factor < 1:
            raise ConfigError("backoff_factor", self.backoff_factor, "a number in (0, 1)")
        if not self.growth_interval >= 1:
            raise ConfigError("growth_interval", self.growth_interval, "an integer >= 1")


@dataclass(frozen=True, kw_only=True)
class ScaleState:
    scale: float
    growth_tracker: int = 0
    """Clean steps in a row since the last change of scale."""


def next_scale_state(state: ScaleState, found_inf: bool, cfg: ScalerConfig) -> ScaleState:
    """The scale after one optimizer step (pure; mirrors ``torch._amp_update_scale_``)."""
    if found_inf:
        return ScaleState(scale=state.scale * cfg.backoff_factor, growth_tracker=0)
    tracker = state.growth_tracker + 1
    if tracker == cfg.growth_interval:
        return ScaleState(scale=state.scale * cfg.growth_factor, growth_tracker=0)
    return replace(state, growth_tracker=tracker)


class Phase(enum.Enum):
    READY = "ready"
    UNSCALED = "unscaled"


class ScalerOrderError(RuntimeError):
    """A scaler call out of order (a bug in the calling loop, not user input)."""


class DynamicLossScaler:
    """Loss scaler for one optimizer; see the module docstring for the call order."""

    enabled = True

    def __init__(self, cfg: ScalerConfig | None = None) -> None:
        self.cfg = cfg or ScalerConfig()
        self.state = ScaleState(scale=self.cfg.init_scale)
        self.phase = Phase.READY
        self._found_inf: bool | None = None

    @property
    def scale(self) -> float:
        return self.state.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.phase is not Phase.READY:
            raise ScalerOrderError("scale_loss() after unscale_() and before update()")
        return loss * self.state.scale

    def unscale_(self, grads: Iterable[torch.Tensor], all_reduce_max: AllReduceMax | None = None) -> bool:
        """Divide gradients by the scale in place; return True if all are finite.

        Forces one host-device sync (reading the overflow flag).
        """
        if self.phase is not Phase.READY:
            raise ScalerOrderError("unscale_() called twice before update()")
        # A sharded (DTensor) gradient is checked and unscaled on this rank's shard; all_reduce_max
        # then makes the ranks agree, so every rank skips the same steps.
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads if g is not None]
        found = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else "cpu")
        inv = torch.full((1,), 1.0 / self.state.scale, dtype=torch.float32, device=found.device)
        by_key: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            by_key.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in by_key.items():
            f = found if device == found.device else torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, f, inv.to(device))
            if f is not found:
                found += f.to(found.device)
        if all_reduce_max is not None:
            all_reduce_max(found)  # every rank must skip the same step
        self._found_inf = bool(found.item() > 0)  # host-device sync
        self.phase = Phase.UNSCALED
        return not self._found_inf

    def update(self) -> None:
        """Advance the scale after the step was taken or skipped."""
        if self.phase is not Phase.UNSCALED:
            raise ScalerOrderError("update() before unscale_()")
        self.state = next_scale_state(self.state, bool(self._found_inf), self.cfg)
        self.phase = Phase.READY
        self._found_inf = None

    def state_dict(self) -> dict:
        return {"scale": self.state.scale, "growth_tracker": self.state.growth_tracker}

    def load_state_dict(self, sd: dict) -> None:
        self.state = ScaleState(scale=float(sd["scale"]), growth_tracker=int(sd["growth_tracker"]))
        self.phase = Phase.READY


class NoScaler:
    """The scaler for fp32/bf16: every method is a no-op, so the step has no branches."""

    enabled = False
    scale = 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, grads: Iterable[torch.Tensor], all_reduce_max: AllReduceMax | None = None) -> bool:
        """Nothing to unscale, but still refuse inf/NaN gradients (False): with clipping off nothing
        else looks at them before the optimizer writes them into the weights.

        Costs one pass over the gradients (multiplied in place by exactly 1.0) and one host-device sync.
        """
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads if g is not None]
        found = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else "cpu")
        by_key: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            by_key.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in by_key.items():
            f = found if device == found.device else torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, f, torch.ones(1, device=device))
            if f is not found:
                found += f.to(found.device)
        if all_reduce_max is not None:
            all_reduce_max(found)  # every rank must skip the same step
        return not bool(found.item() > 0)  # host-device sync

    def update(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass
