"""ONE optimizer step, composed from the levers. Usable from any training loop.

    for each micro-batch -> sync only on the last -> autocast(forward + loss)
      -> backward(loss_sum * world / window_count)
    -> unscale and check (agreed across ranks) -> clip -> step or skip -> zero grads
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from trainfit.levers.accumulation import AccumulationWindow
from trainfit.levers.precision import Precision
from trainfit.meters.timers import NULL_TIMER, Timer
from trainfit.strategies.base import Strategy
from trainfit.strategies.single import Single

LossFn = Callable[[nn.Module, object], tuple[torch.Tensor, object]]
_SINGLE = Single()  # the default strategy, stateless: built once, not once per step


@dataclass(frozen=True)
class StepResult:
    loss: float
    """Mean loss over the window's loss-bearing items, all ranks (NaN if non-finite)."""
    count: int
    """Loss-bearing tokens/samples in the window, all ranks."""
    stepped: bool
    """False when the step was skipped (overflow, non-finite loss)."""
    grad_norm: float | None
    """Global gradient norm before clipping (None when clipping is off or the step skipped)."""
    loss_scale: float
    """The loss scale used for this step (1.0 without scaling)."""


def optimizer_step(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    micro_batches: Sequence,
    loss_fn: LossFn,
    count_fn: Callable[[object], int],
    strategy: Strategy | None = None,
    grad_clip: float = 0.0,
    timer: Timer = NULL_TIMER,
    activations: contextlib.AbstractContextManager | None = None,
) -> StepResult:
    """Run one optimizer step over ``micro_batches`` (this rank's share of the global batch).

    ``timer`` brackets the phases for ``trainfit profile``; the default measures nothing.
    ``activations``: a re-enterable saved-tensors context entered around each forward (the offload
    lever's, which packs what backward needs to host memory); None keeps them where they are.
    """
    strategy = strategy or _SINGLE
    window = AccumulationWindow(
        micro_batches, count_fn, all_reduce_sum=strategy.all_reduce_sum, world_size=strategy.world_size
    )
    scale = precision.loss_scale
    # One autocast context per step, entered around each micro-batch's forward + loss (never backward):
    # built once, not per micro-batch -- part of the step's fixed cost (benchmarks/overhead.py).
    autocast = precision.autocast(strategy.device.type)
    # Phase timers and the offload's saved-tensors context change no number: when neither is given, each
    # micro-batch enters autocast alone. Their no-op contexts, entered per micro-batch, were ~100 us of a
    # loaded machine's bf16 step (issue 29; benchmarks/results/overhead_quiet.md: +29 us after).
    observed = timer is not NULL_TIMER or activations is not None
    saved = activations if activations is not None else contextlib.nullcontext()
    loss_total = 0.0  # becomes a tensor on the loss's device at the first micro-batch (no extra allocation)
    for mb, is_last in window:
        with strategy.sync_context(model, is_last):  # DDP/FSDP: no gradient sync until the last
            if observed:
                with autocast, saved, timer.phase("forward"):  # forward + loss only
                    loss_sum, _ = loss_fn(model, mb)
                with timer.phase("backward_sync" if is_last else "backward"):  # the last one also syncs grads
                    precision.backward(loss_sum * window.weight)  # scaled by the loss scale where needed
            else:
                with autocast:
                    loss_sum, _ = loss_fn(model, mb)
                precision.backward(loss_sum * window.weight)
        loss_total += loss_sum.detach().float()

    strategy.all_reduce_sum(loss_total)
    loss = float(loss_total) / max(window.global_count, 1)  # host-device sync
    with timer.phase("optimizer"):
        stepped, grad_norm = _update(model, optimizer, precision, strategy, grad_clip, math.isfinite(loss))
    return StepResult(loss=loss, count=window.global_count, stepped=stepped, grad_norm=grad_norm, loss_scale=scale)


def _update(model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, strategy: Strategy,
            grad_clip: float, loss_finite: bool) -> tuple[bool, float | None]:
    """Unscale, check, clip and step (or skip a non-finite step), then zero the gradients: (stepped, grad norm)."""
    finite = precision.unscale_and_check(model, strategy.all_reduce_max) and loss_finite
    grad_norm = None
    if finite and grad_clip > 0:
        grad_norm = strategy.clip_grad_norm(precision.optimizer_params(model), grad_clip)
        finite = math.isfinite(grad_norm)
    elif finite and not precision.scales_loss:
        # No clipping and no scaler: nothing has looked at the gradients yet. Refuse inf/NaN before the
        # optimizer writes them into the weights (one pass over the gradients, one host-device sync).
        finite = precision.grads_finite(model, strategy.all_reduce_max)
    stepped = precision.step(optimizer, model, finite)
    precision.zero_grad(optimizer, model)
    return stepped, grad_norm


def evaluate(
    *,
    model: nn.Module,
    precision: Precision,
    batches: Sequence,
    loss_fn: LossFn,
    strategy: Strategy | None = None,
    filler: object | None = None,
) -> tuple[float, int]:
    """The validation loss of ``batches`` (this rank's share): ``(loss_sum, count)`` summed over all ranks.

    Token-weighted: the caller's val loss is ``loss_sum / count``, the same number whatever the split of
    the batches over ranks. No gradient, the run's autocast, the model in eval mode (dropout off, so
    nothing draws from the RNG) and back in its previous mode afterwards.

    Every rank runs the SAME number of forwards (FSDP2 gathers parameters inside each forward, so a rank
    that stopped early would leave its peers waiting): the ranks agree on the largest share with one
    all-reduce(MAX), and a rank with fewer batches repeats its last one (or ``filler``, when its share is
    empty) and discards the result.

    Args:
        batches: this rank's micro-batches, already on the device.
        filler: a batch to run (and discard) when this rank has none but a peer has some.

    Returns:
        ``(loss_sum, count)`` over every rank's batches (two all-reduces; one host-device sync).
    """
    strategy = strategy or _SINGLE
    device = strategy.device
    n = torch.tensor([len(batches)], dtype=torch.int64, device=device)
    strategy.all_reduce_max(n)
    forwards = int(n)  # host-device sync
    if forwards > len(batches) and not batches and filler is None:
        raise ValueError("evaluate: this rank has no batch to repeat; pass filler")
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (loss_sum, count); float64: many batches
    autocast = precision.autocast(device.type)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i in range(forwards):
                mb = batches[i] if i < len(batches) else (batches[-1] if batches else filler)
                with autocast:
                    loss_sum, count = loss_fn(model, mb)
                if i < len(batches):  # a repeat only keeps the ranks in step; its loss is dropped
                    totals[0] += loss_sum.detach().double()
                    totals[1] += count
    finally:
        model.train(was_training)
    strategy.all_reduce_sum(totals)
    loss_sum, count = totals.tolist()  # host-device sync
    return loss_sum, int(round(count))
