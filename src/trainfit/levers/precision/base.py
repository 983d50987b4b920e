"""The precision protocol. A policy decides dtypes, autocast and loss scaling; it never looks at
the parallelism strategy (the strategy asks it for its FSDP2 dtypes, :meth:`Precision.fsdp_policy`).

The loss scaler is a state machine that lives behind this protocol: callers read
``loss_scale`` / ``scales_loss`` / ``mid_step`` and never ``precision.scaler``."""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from torch import nn

from trainfit.errors import CheckpointError
from trainfit.levers.scaler import AllReduceMax, DynamicLossScaler, NoScaler, Phase, ScalerConfig
from trainfit.vocabulary import TORCH_DTYPE_NAMES, PrecisionFacts


def _dtype(name) -> torch.dtype:
    return getattr(torch, TORCH_DTYPE_NAMES[name])


class Precision(Protocol):
    name: str
    param_dtype: torch.dtype
    """dtype the model's weights are stored in for compute."""
    autocast_dtype: torch.dtype | None
    """dtype autocast runs matmuls in, or None when autocast is off."""
    facts: PrecisionFacts
    """This precision's row of the vocabulary."""

    @property
    def loss_scale(self) -> float:
        """The loss scale the next backward multiplies by (1.0 without loss scaling)."""

    @property
    def scales_loss(self) -> bool:
        """Dynamic loss scaling is on: overflowing steps are skipped and the scale adapts."""

    @property
    def mid_step(self) -> bool:
        """Gradients were unscaled and the step not yet finished (a retry now would double-unscale)."""

    def fsdp_policy(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(param_dtype, reduce_dtype) for FSDP2's MixedPrecisionPolicy (None: FSDP2's default)."""

    def grads_finite(self, model: nn.Module, all_reduce_max: AllReduceMax | None = None) -> bool:
        """Whether every gradient the optimizer will read is finite (agreed across ranks)."""

    def prepare(self, model: nn.Module) -> None:
        """Cast the model's weights (and create master copies) before the optimizer is built."""

    def optimizer_params(self, model: nn.Module) -> list[torch.Tensor]:
        """The tensors the optimizer updates (the fp32 master copies where they exist)."""

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """Context for the forward pass and the loss only, never backward. The engine builds it once
        per optimizer step and enters it once per micro-batch, one after another: it must be
        re-enterable sequentially (``torch.autocast`` and ``contextlib.nullcontext`` are; a
        ``@contextmanager`` generator is not)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the (scaled, where needed) loss."""

    def unscale_and_check(self, model: nn.Module, all_reduce_max: AllReduceMax | None = None) -> bool:
        """Move gradients to where the optimizer reads them, unscale; False if any is inf/NaN."""

    def grads(self, model: nn.Module) -> list[torch.Tensor]:
        """The unscaled gradients the optimizer will use (for clipping and checks)."""

    def step(self, optimizer: torch.optim.Optimizer, model: nn.Module, finite: bool) -> bool:
        """Step (or skip when not finite), update the scale; returns whether it stepped."""

    def zero_grad(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


class _Base:
    """Shared plumbing for policies whose optimizer updates the model's own parameters."""

    def __init__(self, facts: PrecisionFacts, *, scaler: ScalerConfig | None = None) -> None:
        self.facts = facts
        self.name = str(facts.name)
        self.param_dtype = _dtype(facts.weights)
        self.autocast_dtype = _dtype(facts.autocast) if facts.autocast else None
        self.scaler: DynamicLossScaler | NoScaler = DynamicLossScaler(scaler) if facts.loss_scaling else NoScaler()

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def scales_loss(self) -> bool:
        return self.scaler.enabled

    @property
    def mid_step(self) -> bool:
        return getattr(self.scaler, "phase", Phase.READY) is not Phase.READY

    def fsdp_policy(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        # Gradients are always reduced in fp32: a bf16 reduce-scatter over many ranks loses the sum's low bits.
        if self.autocast_dtype is None:
            return None, None
        return self.autocast_dtype, torch.float32

    def grads_finite(self, model: nn.Module, all_reduce_max: AllReduceMax | None = None) -> bool:
        return self.scaler.unscale_(self.grads(model), all_reduce_max)  # scale 1: a finiteness check

    def prepare(self, model: nn.Module) -> None:
        pass

    def optimizer_params(self, model: nn.Module) -> list[torch.Tensor]:
        return [p for p in model.parameters() if p.requires_grad]

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        # Returns the context itself rather than a generator-based wrapper: entered once per micro-batch
        # in a hot loop, the wrapper alone cost several us per micro-batch (benchmarks/overhead.py).
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale_loss(loss).backward()

    def grads(self, model: nn.Module) -> list[torch.Tensor]:
        return [p.grad for p in self.optimizer_params(model) if p.grad is not None]

    def unscale_and_check(self, model: nn.Module, all_reduce_max: AllReduceMax | None = None) -> bool:
        if not self.scaler.enabled:  # nothing to unscale: skip walking the parameters (fixed cost per step)
            return True
        return self.scaler.unscale_(self.grads(model), all_reduce_max)

    def step(self, optimizer: torch.optim.Optimizer, model: nn.Module, finite: bool) -> bool:
        if finite:
            optimizer.step()
        # A skipped step leaves parameters and optimizer state untouched: step() is not called.
        self.scaler.update()
        return finite

    def zero_grad(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {"name": self.name, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("name") != self.name:
            raise CheckpointError(
                f"checkpoint was written with precision={sd.get('name')!r}, this run uses {self.name!r}; "
                "resume with the same precision"
            )
        self.scaler.load_state_dict(sd["scaler"])
