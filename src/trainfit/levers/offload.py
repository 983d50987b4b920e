"""Offload to host memory: optimizer state (and its step), zero3's parameters, activations.

``--offload optimizer,params,activations`` names the parts kept in host memory; what that means
depends on the strategy's row (:mod:`trainfit.levers.offload_rules`, the torch-free rules the planner imports
too, decides and refuses; this module is the torch shell that carries them out):

==========================  =========================================================================
strategy + part             what lives on the host, and what crosses the host link per step
==========================  =========================================================================
single/ddp + optimizer      fp32 copies of the trainable weights (the optimizer's master), their
                            gradients (pinned buffers) and the optimizer state; the step runs on the
                            host. Per step: gradients down (device -> host), weights up.
                            The device keeps the weights (in their dtype) and, during backward,
                            their gradients. Under bf16-true/fp16-true the fp32 master copy is the
                            host copy (the device keeps no master): same semantics as
                            ``levers/precision/half_master``, one copy fewer on the device.
zero2 + optimizer           FSDP2's ``CPUOffloadPolicy``: the *sharded* fp32 parameters, their
                            sharded gradients and the optimizer state rest on the host; the step
                            runs there. Parameters are gathered to the device for forward (and kept
                            to the end of backward, zero2's rule); gradients are reduce-scattered on
                            the device, then copied down. FSDP2 moves these three together.
zero3 + optimizer,params    the same policy; zero3 frees the gathered parameters after forward and
                            gathers them from the host again in backward. Both parts must be named:
                            FSDP2 cannot move one without the other.
any + activations           tensors saved for backward are copied to the host in forward and back in
                            backward (``torch.autograd.graph.save_on_cpu``'s scheme, pinned when the
                            device is a GPU). Parameters (and views of them) saved for backward stay
                            where they are: they are resident anyway. Under activation checkpointing
                            only what the checkpointed blocks keep (their inputs) is offloaded.
==========================  =========================================================================

Refused (read from each row's ``offload_parts`` and ``offload_refusal``): ``params`` without zero3 (only
FSDP2 can gather parameters from the host), zero3 with only one of optimizer/params, zero1 + optimizer
(``ZeroRedundancyOptimizer`` broadcasts the stepped partition with the device's collective, which cannot send
host tensors under NCCL).

The tracker (:mod:`trainfit.meters.tracker`) counts each storage as device or host: the shell marks
the host tensors it creates (:func:`~trainfit.meters.tracker.mark_host`) and reports the activations it
packs (:func:`~trainfit.meters.tracker.note_saved`), so the split is right even on a CPU-only machine,
where both sides are "cpu".
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from trainfit.errors import CheckpointError
from trainfit.levers.offload_rules import OffloadPlan, host_optimizer_bytes, plan_offload, single_device_offload
from trainfit.levers.precision import Precision
from trainfit.levers.scaler import AllReduceMax
from trainfit.meters.tracker import host_scope, mark_host, note_saved


# ---- the torch shell ------------------------------------------------------------------------------------
def _pin(device: torch.device) -> bool:
    """Pinned (page-locked) host memory: only with a CUDA device (copies become asynchronous DMA)."""
    return device.type == "cuda"


class HostOptimizer:
    """A precision policy whose optimizer updates fp32 host copies of the weights (ZeRO-Offload's scheme).

    Wraps the run's precision: autocast, loss scaling and backward are the inner policy's; the optimizer
    is built over :meth:`optimizer_params` (host tensors), so its state is created on the host.

        unscale_and_check: device grads -> pinned host buffers (fp32), device grads freed, unscale there
        step:              optimizer.step() on the host, then the weights copied back up (cast to the
                           model's dtype under bf16-true/fp16-true)
    """

    def __init__(self, inner: Precision, *, device: torch.device) -> None:
        self.inner = inner
        self.device = torch.device(device)
        self.pin = _pin(self.device)
        self.facts, self.name = inner.facts, inner.name
        self.param_dtype, self.autocast_dtype = inner.param_dtype, inner.autocast_dtype
        self._pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._buffers: list[torch.Tensor] = []
        """One fp32 host gradient buffer per pair, kept for the run (pinned memory is slow to allocate)."""

    @property
    def scaler(self):
        return self.inner.scaler  # levers/ may read the scaler; nothing outside levers/ does

    @property
    def loss_scale(self) -> float:
        return self.inner.loss_scale

    @property
    def scales_loss(self) -> bool:
        return self.inner.scales_loss

    @property
    def mid_step(self) -> bool:
        return self.inner.mid_step

    def fsdp_policy(self):
        return self.inner.fsdp_policy()

    def autocast(self, device_type: str):
        return self.inner.autocast(device_type)

    def backward(self, loss: torch.Tensor) -> None:
        self.inner.backward(loss)

    @torch.no_grad()
    def prepare(self, model: nn.Module) -> None:
        """Exact fp32 host copies of the trainable weights (with a gradient buffer each), then the model's cast.

        Taken before the strategy moves/broadcasts the model, like ``half_master``'s masters: every rank
        builds the same initial weights from the seed.
        """
        self._pairs, self._buffers = [], []
        for p in model.parameters():
            if not p.requires_grad or not p.is_floating_point():
                continue
            h = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=self.pin)
            h.copy_(p.detach())
            h.requires_grad_(True)
            # Assigned as h.grad from the start, so a tracker registering the run counts it (host grads).
            h.grad = torch.zeros(p.shape, dtype=torch.float32, device="cpu", pin_memory=self.pin)
            mark_host([h, h.grad])
            self._pairs.append((p, h))
            self._buffers.append(h.grad)
        if self.facts.master_copy:
            model.to(self.param_dtype)  # the fp32 master is the host copy; the device keeps half weights only

    def optimizer_params(self, model: nn.Module) -> list[torch.Tensor]:
        if not self._pairs and any(p.requires_grad for p in model.parameters()):
            raise RuntimeError("prepare(model) must run before the optimizer is built")
        return [h for _, h in self._pairs]

    def grads(self, model: nn.Module) -> list[torch.Tensor]:
        return [h.grad for _, h in self._pairs if h.grad is not None]

    def _grads_to_host(self) -> None:
        for (p, h), buf in zip(self._pairs, self._buffers):
            if p.grad is None:  # no gradient this step (unused parameter): the optimizer skips it
                h.grad = None
                continue
            buf.copy_(p.grad, non_blocking=self.pin)  # device -> host (+ half -> fp32)
            h.grad = buf
            p.grad = None  # the device gradient is freed before the step
        if self.pin:
            torch.cuda.synchronize(self.device)  # host-device sync: the host reads the gradients next

    def unscale_and_check(self, model: nn.Module, all_reduce_max: AllReduceMax | None = None) -> bool:
        self._grads_to_host()
        if not self.scales_loss:
            return True
        return self.scaler.unscale_(self.grads(model), all_reduce_max)

    def grads_finite(self, model: nn.Module, all_reduce_max: AllReduceMax | None = None) -> bool:
        return self.scaler.unscale_(self.grads(model), all_reduce_max)  # scale 1: a finiteness check

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, model: nn.Module, finite: bool) -> bool:
        if finite:
            with host_scope():  # its scratch tensors are host memory too
                optimizer.step()  # on the host
        self.scaler.update()
        if finite:
            # host -> device; asynchronous from pinned memory: the next step's sync (above) orders it before
            # the host writes these tensors again.
            for p, h in self._pairs:
                p.copy_(h, non_blocking=self.pin)
        return finite

    def zero_grad(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        # The host buffers stay (pinned memory is slow to allocate); they are overwritten next step.
        for p in model.parameters():
            p.grad = None

    def state_dict(self) -> dict:
        # The same keys as half_master's: a checkpoint moves between offloaded and resident runs.
        return {"name": self.name, "scaler": self.scaler.state_dict(), "master": [h.detach() for _, h in self._pairs]}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        if sd.get("name") != self.name:
            raise CheckpointError(f"checkpoint was written with precision={sd.get('name')!r}, this run uses "
                                  f"{self.name!r}; resume with the same precision")
        self.scaler.load_state_dict(sd["scaler"])
        masters = sd.get("master")
        if masters is None:  # written without a master (fp32, not offloaded): the model's weights are it
            for p, h in self._pairs:
                h.copy_(p)
            return
        if len(masters) != len(self._pairs):
            raise CheckpointError(f"checkpoint has {len(masters)} master weights, model has {len(self._pairs)}")
        for (p, h), saved in zip(self._pairs, masters):
            h.copy_(saved)
            p.copy_(h)


def _is_param(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


class HostActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved-for-backward tensors copied to the host in forward, back to their device in backward.

    ``torch.autograd.graph.save_on_cpu``'s scheme, with two differences: parameters stay where they are
    (they are resident; copying them would only add host bytes), and a copy is always made (on a
    CPU-only machine the "host" copy stands in for the device-to-host transfer, so the tracker sees the
    split the GPU run has). And a tensor saved by several ops (a norm's output feeding q, k and v) is
    copied once: ``save_on_cpu`` copies it once per op. Re-enterable one use after another (the engine
    enters it per micro-batch).
    """

    def __init__(self, device: torch.device) -> None:
        self.pin = _pin(torch.device(device))
        self._copies: dict[tuple, tuple[StorageWeakRef, weakref.ref]] = {}
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if _is_param(t):
            note_saved(t, host=False)
            return t
        key = (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
        seen = self._copies.get(key)
        host = seen[1]() if seen is not None and not seen[0].expired() else None  # same tensor, still alive
        if host is None:
            with host_scope():
                host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="cpu", pin_memory=self.pin)
                host.copy_(t, non_blocking=self.pin)  # device -> host; the unpack's copy back is ordered after it
            self._copies[key] = (StorageWeakRef(t.untyped_storage()), weakref.ref(host))
        note_saved(host, host=True)
        return (t.device, host)

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=self.pin)


@dataclass(frozen=True, kw_only=True)
class Offload:
    """The offload lever of a built run: its plan and what the engine and strategy need from it."""

    plan: OffloadPlan
    device: torch.device

    def wrap_precision(self, precision: Precision) -> Precision:
        """The precision the run steps with: :class:`HostOptimizer` around it for single/ddp optimizer offload."""
        return HostOptimizer(precision, device=self.device) if self.plan.host_optimizer else precision

    def wrap_options(self) -> dict:
        """Keyword arguments for ``strategy.wrap`` (FSDP2's CPU offload; empty for the others)."""
        return {"cpu_offload": True} if self.plan.fsdp_cpu_offload else {}

    def after_wrap(self, model: nn.Module) -> None:
        """Mark FSDP2's host-resident shards for the tracker (their gradients and state follow them)."""
        if self.plan.fsdp_cpu_offload:
            mark_host(model.parameters())

    def activations(self) -> contextlib.AbstractContextManager | None:
        """The context the engine enters around each forward (None: activations stay on the device)."""
        return HostActivations(self.device) if self.plan.activations else None


def make_offload(spec: str, strategy: str, device: torch.device) -> Offload:
    """The lever for ``cfg.offload`` under ``cfg.strategy`` on ``device``; raises ConfigError when refused."""
    return Offload(plan=plan_offload(spec, strategy), device=torch.device(device))


__all__ = ["OffloadPlan", "plan_offload", "single_device_offload", "host_optimizer_bytes", "HostOptimizer",
           "HostActivations", "Offload", "make_offload"]
