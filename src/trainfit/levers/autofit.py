"""Auto-fit while running (``micro_batch = "auto"``): shrink the micro-batch on out-of-memory.

On ``torch.OutOfMemoryError`` (on CPU, the memory cap enforced by the tracker stands in for
it) every rank agrees through an all-reduce(MAX) of its out-of-memory flag; the micro-batch
halves and the accumulation doubles, so each rank's samples per step -- and the global
batch -- stay the same; and the failed step is redone from its start: its gradients are
dropped, the loss scaler is returned to READY, and the step's *same* samples are re-cut
into the smaller micro-batches (the data order depends only on the step and the per-rank
share, see ``trainfit.data``). No sample is skipped or counted twice.

Pure core: :func:`shrink`. Shell: :class:`Fitter`, which the training loop asks for each
step's micro-batches and through which it steps. With auto-fit off and no cap it is a
pass-through (no branches in the loop).

Limits: an out-of-memory inside the optimizer update itself is re-raised (a smaller
micro-batch does not shrink it); a rank that runs out of memory while its peers already
wait in a gradient collective leaves them waiting until the collective timeout
(``collective_timeout_s``) -- with deferred sync that can only happen in the window's last
micro-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Any, Protocol

import torch
from torch import nn

from trainfit.config import RunConfig
from trainfit.data import make_loader
from trainfit.errors import ConfigError, TrainfitError
from trainfit.levers.precision import Precision
from trainfit.meters.tracker import memory_cap
from trainfit.tasks.base import Task, to_device


class StepOutOfMemory(TrainfitError):
    """A step ran out of memory with auto-fit off; ``trainfit train`` explains it (``probes.oom``)."""

    def __init__(self, message: str, *, micro_batch: int, accumulation: int, step: int) -> None:
        super().__init__(message)
        self.micro_batch, self.accumulation, self.step = micro_batch, accumulation, step
        """The split that did not fit, and the optimizer step (1-based) it failed in."""


class _Ranks(Protocol):
    """The part of a strategy auto-fit uses: where this rank is, and one collective to agree on out-of-memory."""

    rank: int
    world_size: int
    device: torch.device

    def all_reduce_max(self, t: torch.Tensor) -> None: ...


class Steppable(Protocol):
    """What the Fitter reads of the run it steps; :class:`trainfit.run.Run` is one. Declared here, below the
    run, so the lever never imports upward (not even for annotations)."""

    cfg: RunConfig
    task: Task
    model: nn.Module
    optimizer: torch.optim.Optimizer
    precision: Precision
    strategy: _Ranks

    def step(self, micro_batches: list, **kw: Any) -> Any:
        """One optimizer step (``engine.StepResult``)."""


def shrink(micro_batch: int, accumulation: int) -> tuple[int, int]:
    """The next (micro_batch, accumulation) after an out-of-memory, same samples per rank (pure).

    Halves an even micro-batch; an odd one goes to the largest smaller divisor of the
    per-rank share, so the split stays exact.

    Raises:
        TrainfitError: the micro-batch is already 1.
    """
    if micro_batch <= 1:
        raise TrainfitError("auto-fit: out of memory at micro-batch 1; nothing left to halve -- enable "
                            "checkpointing, a half precision or a sharding strategy (see `trainfit plan`)")
    share = micro_batch * accumulation
    new = micro_batch // 2 if micro_batch % 2 == 0 else max(d for d in range(1, micro_batch) if share % d == 0)
    return new, share // new


def resolve_auto(cfg, world_size: int):
    """The config with ``micro_batch="auto"`` replaced by the starting split (unchanged otherwise).

    Starts from the whole per-rank share in one micro-batch (accumulation 1): the largest
    micro-batch the global batch allows; auto-fit then halves it until it fits.
    """
    if cfg.micro_batch != "auto":
        return cfg
    if not cfg.global_batch:
        raise ConfigError("global_batch", cfg.global_batch, "an integer >= 1 with micro_batch=auto",
                          "auto-fit keeps the global batch fixed, so it must be given")
    share, rest = divmod(cfg.global_batch, world_size)
    if rest:
        raise ConfigError("global_batch", cfg.global_batch, f"a multiple of the world size {world_size}")
    return dataclasses.replace(cfg, micro_batch=share, accumulation=1)


class Fitter:
    """Feeds the training loop each step's micro-batches and steps them, shrinking on out-of-memory.

    Args:
        run: the built run (:func:`trainfit.run.build_run`); the Fitter steps it through ``run.step``.
        start_step: first optimizer step (after a resume).
        auto: shrink on out-of-memory (``micro_batch="auto"``); otherwise re-raise it.
    """

    def __init__(self, run: Steppable, *, start_step: int, auto: bool) -> None:
        self.run, self.auto = run, auto
        self.micro_batch, self.accumulation = run.cfg.micro_batch, run.cfg.accumulation
        self.events: list[dict] = []
        """One entry per shrink: step, old and new split."""
        self._updating = False
        # Observed from outside the step: once the optimizer update starts, a retry is unsafe.
        run.optimizer.register_step_pre_hook(lambda *_: setattr(self, "_updating", True))
        self._open(start_step)

    def _open(self, step: int) -> None:
        cfg, st = self.run.cfg, self.run.strategy
        loader = make_loader(self.run.task.dataset(), self.run.task.collate, start_step=step,
                             micro_batch=self.micro_batch, accumulation=self.accumulation, rank=st.rank,
                             world_size=st.world_size, seed=cfg.seed, workers=cfg.loader_workers,
                             pin_memory=st.device.type == "cuda")  # pinned pages: asynchronous host-to-device copies
        self._batches = iter(loader)

    def close(self) -> None:
        """Stop the DataLoader workers now: the run's objects sit in reference cycles, so waiting for
        the garbage collector would leave worker processes and their pipes open after train() returns."""
        self._batches = None

    def micro_batches(self) -> list:
        """This rank's micro-batches of the next step (blocks on the loader)."""
        return [next(self._batches) for _ in range(self.accumulation)]

    def _cap(self):
        cap = self.run.cfg.memory_cap
        if not cap:
            return contextlib.nullcontext()
        run = self.run
        return memory_cap(cap, model=run.model, optimizer=run.optimizer,
                          optimizer_params=run.precision.optimizer_params(run.model))

    def step(self, step: int, micro_batches: list, **step_kw) -> Any:
        """One optimizer step over ``micro_batches``, redone with a smaller split after an out-of-memory."""
        run, st = self.run, self.run.strategy
        while True:
            oom: torch.OutOfMemoryError | None = None
            res, self._updating = None, False
            try:
                with self._cap():
                    res = run.step(micro_batches, **step_kw)
            except torch.OutOfMemoryError as e:
                oom = e
            if not self._agree(oom is not None):
                return res
            if oom is None:
                raise TrainfitError("auto-fit: another rank ran out of memory after this rank had stepped")
            if not self.auto:
                raise StepOutOfMemory(f"out of memory at micro_batch={self.micro_batch}: {oom} -- pass "
                                      "--micro-batch auto (with --global-batch) to shrink it while running, or "
                                      "see `trainfit plan`", micro_batch=self.micro_batch,
                                      accumulation=self.accumulation, step=step + 1) from oom
            self._drop_partial_step(oom)
            old = (self.micro_batch, self.accumulation)
            self.micro_batch, self.accumulation = shrink(*old)
            self.events.append({"step": step + 1, "from": old, "to": (self.micro_batch, self.accumulation)})
            self._open(step)  # the same samples of this step, cut smaller
            micro_batches = [to_device(mb, st.device) for mb in self.micro_batches()]

    def _agree(self, local_oom: bool) -> bool:
        flag = torch.tensor([1.0 if local_oom else 0.0], device=self.run.strategy.device)
        self.run.strategy.all_reduce_max(flag)  # every rank shrinks together
        return bool(flag.item() > 0)  # host-device sync

    def _drop_partial_step(self, oom: torch.OutOfMemoryError) -> None:
        run = self.run
        if self._updating or run.precision.mid_step:
            # The update may be partly applied, and a smaller micro-batch does not shrink it.
            raise TrainfitError(f"out of memory in the optimizer update, after the micro-batches fit: {oom} -- "
                                "shard the optimizer state (zero1-3) or use a smaller optimizer") from oom
        run.precision.zero_grad(run.optimizer, run.model)  # no gradient left over from the failed try
        gc.collect()
        if run.strategy.device.type == "cuda":
            torch.cuda.empty_cache()
