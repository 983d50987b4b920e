"""The learning-rate schedule: linear warm-up, then constant, linear or cosine decay to ``min_lr``.

Pure core: :func:`lr_factor` -- the multiplier of the peak ``lr`` for the optimizer step with 0-based index
``step``. Thin torch shell: :func:`make_scheduler` -- PyTorch's own ``LambdaLR`` over that factor, whose
``state_dict`` (``last_epoch``, ``base_lrs``, ``_last_lr``: plain numbers) goes into checkpoints.

The convention (one clock, ``t = step + 1``: the factor is the schedule's value at the END of the step)::

    warm-up   step < W:   t / W                 step 0 gets lr/W, step W-1 the full lr
    decay     step >= W:  progress = (t - W) / (T - W)   in (0, 1], 1 at the last step (T - 1)
      constant            1
      linear              1 - (1 - m) * progress            m = min_lr / lr
      cosine              m + (1 - m) * (1 + cos(pi * progress)) / 2

Why ``(step + 1) / W`` and not Hugging Face's ``step / W`` (``get_linear_schedule_with_warmup``): HF's first
step has lr 0 -- a full forward/backward whose update is nothing (AdamW's decoupled decay is ``1 - lr * wd`` =
1 too). Ours makes every warm-up step count, reaches the peak on the last warm-up step and ``min_lr`` exactly
on the last step of the run (``T - 1``), as the config promises ("to min_lr at the last step"); the two
pieces meet at ``t = W`` (both 1), so there is no jump. With ``min_lr = 0`` the last step of a linear or
cosine run therefore updates nothing -- set ``min_lr`` > 0 to make it count.

The schedule follows the training loop's step count, not the optimizer's: a step skipped for overflow (fp16)
still moves it on (:meth:`trainfit.run.Run.step` advances it after every ``optimizer_step`` that returns),
so step ``s`` always uses ``lr_factor(s)`` and a resumed run is the uninterrupted one. A step that raised
(out-of-memory, redone smaller by :mod:`trainfit.levers.autofit`) does not move it.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from trainfit.vocabulary import Schedule


def lr_factor(step: int, *, schedule: Schedule | str, warmup_steps: int, total_steps: int, lr: float,
              min_lr: float) -> float:
    """The multiplier of the peak ``lr`` for the optimizer step with 0-based index ``step``.

    Args:
        step: 0-based optimizer step (steps at or past ``total_steps`` get the last step's factor).
        schedule: constant, linear or cosine (after the warm-up).
        warmup_steps: steps of linear warm-up (0: none).
        total_steps: steps in the run (``RunConfig.steps``).
        lr, min_lr: peak and final learning rate (``min_lr <= lr``); only their ratio is used.

    Returns:
        A number in [0, 1]: ``lr * lr_factor(...)`` is the step's learning rate.

    Raises:
        ValueError: a negative step or warm-up, or ``total_steps`` < 1 (internal: RunConfig validates these).
    """
    if step < 0 or warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"lr_factor: step={step}, warmup_steps={warmup_steps}, total_steps={total_steps}")
    if not isinstance(schedule, Schedule):  # the run's config holds the member already: no lookup per step
        schedule = Schedule(schedule)
    t = step + 1
    if t <= warmup_steps:  # includes every step when the warm-up is as long as the run
        return t / warmup_steps
    if schedule == Schedule.CONSTANT:
        return 1.0
    floor = min_lr / lr if lr > 0 else 0.0
    span = max(total_steps - warmup_steps, 1)  # steps after the warm-up (past the run's end: clamped below)
    progress = min((t - warmup_steps) / span, 1.0)
    if schedule == Schedule.LINEAR:
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, cfg) -> LambdaLR:
    """PyTorch's ``LambdaLR`` over :func:`lr_factor` for ``cfg`` (a RunConfig: schedule, warmup_steps, steps,
    lr, min_lr). Built after the optimizer (and after zero1 wraps it); at construction it sets every group's
    lr to ``lr * lr_factor(0)``, so the first step already uses the schedule.

    A constant schedule without warm-up multiplies by exactly 1.0: the lr, and so every update, is bitwise
    what it was without a scheduler.
    """
    schedule, warmup, total, lr, min_lr = Schedule(cfg.schedule), cfg.warmup_steps, cfg.steps, cfg.lr, cfg.min_lr

    def factor(step: int) -> float:  # a plain function: LambdaLR's state_dict stores None for it
        return lr_factor(step, schedule=schedule, warmup_steps=warmup, total_steps=total, lr=lr, min_lr=min_lr)

    flat = schedule == Schedule.CONSTANT and warmup == 0  # the default: every step's factor is exactly 1.0
    return (_Flat if flat else LambdaLR)(optimizer, factor)


class _Flat(LambdaLR):
    """``LambdaLR`` over a factor that is 1.0 at every step (constant, no warm-up): a step leaves every lr
    as it is, so :meth:`step` only counts -- the state (``last_epoch``, ``_step_count``, ``_last_lr``) is
    the one ``LambdaLR.step`` leaves, without its walk over the groups, once per optimizer step on the
    training loop's hot path (issue 29: most of what ``Run.step`` adds to ``optimizer_step``)."""

    def step(self, epoch: int | None = None) -> None:
        if epoch is not None or not hasattr(self, "_last_lr"):  # the constructor's first step, an explicit epoch
            super().step(epoch)
            return
        self._step_count += 1
        self.last_epoch += 1


def advance(scheduler: LRScheduler, *, stepped: bool) -> None:
    """Move the schedule to the next step; call once per optimizer step, skipped (``stepped=False``) or not.

    PyTorch warns when the first ``scheduler.step()`` comes before any ``optimizer.step()`` (it suspects the
    pre-1.1 order). Here that happens by design when the first step is skipped for overflow, or after a
    resume: that one warning is silenced; the schedule is the same either way.
    """
    if stepped:
        scheduler.step()
        return
    _unwarned(scheduler.step)


def _unwarned(step) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before", category=UserWarning)
        step()


def restore_scheduler(scheduler: LRScheduler, state: dict | None, next_step: int) -> None:
    """Put ``scheduler`` -- and every param group's lr -- where a checkpoint left it.

    Args:
        state: the scheduler's saved ``state_dict``; None for a checkpoint written before schedules were
            stored (the schedule then starts at ``next_step``, as if it had always been there).
        next_step: the step the resumed run runs next.

    The groups' lr are set from the schedule (``_last_lr`` as saved, to the bit): a sharded checkpoint stores
    the optimizer's state tensors but not its param groups, so nothing else would restore them.
    """
    if state is None:
        scheduler.last_epoch = next_step - 1
        # torch's own step (also for the flat default, whose step only counts): last_epoch -> next_step and
        # every group's lr = base_lr * factor(next_step), whatever lr the restored optimizer brought
        _unwarned(lambda: LRScheduler.step(scheduler))
        return
    scheduler.load_state_dict(dict(state))
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
