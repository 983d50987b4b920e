"""bf16-true / fp16-true: half-precision weights, fp32 master copy for the optimizer.

Why the master copy (Micikevicius et al., 2018): an update smaller than half the spacing
of the half-precision numbers around a weight rounds away when added to that weight; in
fp32 it accumulates until it shows. So the optimizer updates fp32 masters, and the
weights used for compute are re-rounded from them after each step.

Memory per parameter (Adam): 2 (half weight) + 2 (half grad) + 4 (master) + 8 (Adam m, v)
+ 4 transiently (fp32 grad of the master while stepping).
"""

from __future__ import annotations

import torch
from torch import nn

from trainfit.errors import CheckpointError
from trainfit.levers.precision.base import _Base
from trainfit.levers.scaler import AllReduceMax, ScalerConfig
from trainfit.vocabulary import PrecisionFacts


class HalfWithMaster(_Base):
    """Half weights in the model, fp32 master copies in the optimizer (the row's ``master_copy``)."""

    def __init__(self, facts: PrecisionFacts, *, scaler: ScalerConfig | None = None) -> None:
        super().__init__(facts, scaler=scaler)
        self._pairs: list[tuple[nn.Parameter, torch.Tensor]] = []

    def prepare(self, model: nn.Module) -> None:
        """Keep exact fp32 copies, then cast floating weights and buffers to half."""
        self._pairs = []
        for p in model.parameters():
            if not p.requires_grad or not p.is_floating_point():
                continue
            master = p.detach().to(torch.float32, copy=True).requires_grad_(True)
            self._pairs.append((p, master))
        model.to(self.param_dtype)

    def optimizer_params(self, model: nn.Module) -> list[torch.Tensor]:
        if not self._pairs:
            raise RuntimeError("prepare(model) must run before the optimizer is built")
        return [m for _, m in self._pairs]

    def unscale_and_check(self, model: nn.Module, all_reduce_max: AllReduceMax | None = None) -> bool:
        for p, m in self._pairs:
            # fp32 copy of the half gradient; the scale is divided out in fp32, so no underflow.
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None  # the half gradient is no longer needed: free it before the step
        return self.scaler.unscale_(self.grads(model), all_reduce_max)

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, model: nn.Module, finite: bool) -> bool:
        stepped = super().step(optimizer, model, finite)
        if stepped:
            for p, m in self._pairs:
                p.copy_(m)  # round-to-nearest into half precision
        return stepped

    def zero_grad(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        optimizer.zero_grad(set_to_none=True)
        for p, _ in self._pairs:
            p.grad = None

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["master"] = [m.detach() for _, m in self._pairs]
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        masters = sd["master"]
        if len(masters) != len(self._pairs):
            raise CheckpointError(f"checkpoint has {len(masters)} master weights, model has {len(self._pairs)}")
        for (p, m), saved in zip(self._pairs, masters):
            m.copy_(saved)
            p.copy_(m)
