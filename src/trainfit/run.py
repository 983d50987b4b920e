"""The built run: one typed object made once from a RunConfig, and the one way to step it.

    build_run(cfg): task -> model -> checkpointing -> precision.prepare -> strategy.wrap -> optimizer
    run.step(micro_batches, timer=...)   one optimizer step (``engine.optimizer_step``)
    run.save(step) / run.load(run_dir)   checkpoints, through the strategy (``.pt`` or sharded DCP)

The training loop, memory measure and estimate, profile, verify, calibration and auto-fit all
step a run through :meth:`Run.step`; none of them re-assembles the engine's arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from trainfit.checkpoint import check_resumable, first_cause, restore_rng, resume_record, rng_state
from trainfit.config import RunConfig, ScheduleSection
from trainfit.engine import LossFn, StepResult, optimizer_step
from trainfit.errors import CheckpointError, ConfigError
from trainfit.export import init_weights
from trainfit.levers.accumulation import warn_if_batchnorm
from trainfit.levers.checkpointing import apply_checkpointing
from trainfit.levers.compile import CompileInfo, apply_compile
from trainfit.levers.finetune import apply_lora, freeze, lora_block_names
from trainfit.levers.offload import Offload, plan_offload
from trainfit.levers.param_groups import param_groups, summary
from trainfit.levers.precision import Precision, make_precision
from trainfit.levers.schedule import advance, make_scheduler, restore_scheduler
from trainfit.meters.timers import NULL_TIMER, Timer
from trainfit.strategies import Strategy, make_strategy
from trainfit.tasks.base import Task
from trainfit.tasks.make import task_of
from trainfit.vocabulary import Optimizer, parse_lora


def make_optimizer(schedule: ScheduleSection, params: list[torch.Tensor], *,
                   model: nn.Module | None = None) -> torch.optim.Optimizer:
    """The configured optimizer over ``params`` (torch's default implementation for the device).

    With ``model`` (whose trainable parameters ``params`` are, in order -- or their master copies) and a
    weight decay, the standard groups (:mod:`trainfit.levers.param_groups`): decay on weight matrices only,
    none on biases, norm weights and embeddings. Without ``model`` every parameter decays (one group).
    Adam takes no weight decay here (``weight_decay`` is AdamW's decoupled one, or SGD's).
    ``schedule`` is the config's schedule section (``cfg.section("schedule")``).
    """
    decay = 0.0 if schedule.optimizer == Optimizer.ADAM else schedule.weight_decay
    groups = param_groups(model, params, decay) if model is not None else params
    if schedule.optimizer == Optimizer.ADAMW:
        return torch.optim.AdamW(groups, lr=schedule.lr, weight_decay=schedule.weight_decay)
    if schedule.optimizer == Optimizer.ADAM:
        return torch.optim.Adam(groups, lr=schedule.lr)
    return torch.optim.SGD(groups, lr=schedule.lr, momentum=0.9, weight_decay=schedule.weight_decay)


@dataclass
class Run:
    """Everything built for one run. Step it with :meth:`step`; checkpoint it with :meth:`save`/:meth:`load`."""

    cfg: RunConfig
    task: Task
    model: nn.Module
    precision: Precision
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    """The learning-rate schedule (:mod:`trainfit.levers.schedule`), moved once per :meth:`step`."""
    checkpointed: list[str] = field(default_factory=list)
    """Blocks wrapped in activation checkpointing."""
    batchnorm: list[str] = field(default_factory=list)
    """BatchNorm modules (they see one micro-batch, not the accumulated batch)."""
    frozen: list[str] = field(default_factory=list)
    """Parameters ``--freeze`` froze (LoRA's frozen base weights are not listed)."""
    compiled: CompileInfo | None = None
    """What ``--compile`` compiled and how many graphs since (``compiled.graphs()``); None when off."""
    offload: Offload | None = None
    """What ``--offload`` keeps in host memory (:mod:`trainfit.levers.offload`); None: nothing."""

    def step(self, micro_batches: Sequence, *, timer: Timer = NULL_TIMER, loss_fn: LossFn | None = None,
             strategy: Strategy | None = None) -> StepResult:
        """One optimizer step over this rank's ``micro_batches`` (already on the device).

        ``timer`` brackets the phases (profile); ``loss_fn`` and ``strategy`` let a probe observe the
        task's loss or the strategy's collectives from outside (memory labels phases, profile times
        collectives) -- the step itself is the training step.
        """
        res = optimizer_step(model=self.model, optimizer=self.optimizer, precision=self.precision,
                             micro_batches=micro_batches, loss_fn=loss_fn or self.task.loss,
                             count_fn=self.task.count, strategy=strategy or self.strategy,
                             grad_clip=self.cfg.grad_clip, timer=timer,
                             activations=self.offload.activations() if self.offload else None)
        # Only once the step returned (a step that raised, e.g. out-of-memory redone smaller by auto-fit, has
        # not happened); skipped steps too: the schedule follows the loop's step count.
        advance(self.scheduler, stepped=res.stepped)
        return res

    def current_lr(self) -> float:
        """The learning rate the next :meth:`step` uses (the first group's; every group has the same)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def param_groups_summary(self) -> list[dict]:
        """Per optimizer group: weight decay, tensors, elements (decayed matrices first when decay is on)."""
        return summary(self.optimizer)

    def optimizer_params(self) -> list[torch.Tensor]:
        """What the optimizer updates (the fp32 master copies where the precision keeps them)."""
        return self.precision.optimizer_params(self.model)

    # -- checkpoints -------------------------------------------------------------------------------------
    def save(self, step: int) -> None:
        """Checkpoint after ``step`` optimizer steps, in the strategy's format."""
        self.strategy.save(self, step)

    def load(self, run_dir: str | Path) -> int | None:
        """Restore the newest checkpoint in ``run_dir``; the next step to run, or None when there is none."""
        return self.strategy.load(self, Path(run_dir))

    def state(self, step: int) -> dict:
        """The whole state of a one-file checkpoint after ``step`` optimizer steps."""
        return {
            "step": step,
            "config": resume_record(self.cfg),  # the job and its data's identity, compared on resume
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "precision": self.precision.state_dict(),
            "schedule": self.scheduler.state_dict(),
            "rng": rng_state(self.strategy.device),
            "data": {"next_step": step},
        }

    def restore(self, state: dict, path: Path) -> int:
        """Load a one-file checkpoint's ``state``; returns the next step to run."""
        missing = [k for k in STATE_KEYS if k not in state]
        if missing or not isinstance(state.get("data"), dict) or "next_step" not in state["data"]:
            raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing) or 'data.next_step'} (a trainfit "
                                  f"checkpoint holds {', '.join(STATE_KEYS)}); resume from another checkpoint or "
                                  "start a new --run-dir")
        saved = state.get("config") or self.cfg.to_dict()  # a one-file checkpoint is written by one process
        if not isinstance(saved, dict):
            raise CheckpointError(f"checkpoint {path}: its config is not a table of settings")
        check_resumable(saved, 1, resume_record(self.cfg), self.strategy.world_size, path)
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.precision.load_state_dict(state["precision"])
        except (KeyError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path} does not match this model/optimizer: {first_cause(e)}") from None
        try:
            restore_rng(state["rng"], self.strategy.device)
            next_step = int(state["data"]["next_step"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path}: its random-number state or step is unreadable "
                                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        try:  # absent from a checkpoint written before schedules: the schedule starts at next_step
            restore_scheduler(self.scheduler, state.get("schedule"), next_step)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"checkpoint {path}: its learning-rate schedule state is unreadable "
                                  f"({type(e).__name__}); resume from another checkpoint") from None
        return next_step


STATE_KEYS = ("step", "model", "optimizer", "precision", "rng", "data")
"""What a one-file checkpoint must hold (:meth:`Run.state` writes them); ``config`` is read when present."""


def build_run(cfg: RunConfig, *, strategy: Strategy | None = None) -> Run:
    """Task -> model -> checkpointing -> precision -> compile -> strategy wrap -> optimizer."""
    plan = plan_offload(cfg.offload, cfg.strategy)  # refuses what cannot be offloaded, before any work
    task = task_of(cfg)
    strategy = strategy or make_strategy(cfg)
    offload = Offload(plan=plan, device=strategy.device)
    model = task.build_model()
    if not isinstance(model, nn.Module):
        raise ConfigError("model", cfg.model, "a factory returning a torch.nn.Module")
    # Weights in, then what trains: on the model as the task built it, before any wrapping (names as its own).
    if cfg.init_from:
        init_weights(model, cfg.init_from)  # weights only: optimizer, schedule and data order start fresh
    blocks = task.block_names(model)
    frozen = freeze(model, cfg.freeze)
    lora = parse_lora(cfg.lora)
    if lora is not None:
        model = apply_lora(model, lora)  # freezes every base weight; the adapters are what trains
        blocks = lora_block_names(model, blocks)
    bn = warn_if_batchnorm(model, cfg.accumulation)
    # before sharding; budget:F under compile sets the compiler's activation_memory_budget instead
    checkpointed = apply_checkpointing(model, cfg.checkpointing, blocks, compiled=cfg.compile)
    precision = offload.wrap_precision(make_precision(cfg.precision))  # the step on the host for optimizer offload
    precision.prepare(model)
    # torchtitan's order: checkpointing -> compile each block -> fully_shard; the compiled forward is an
    # instance attribute, so DDP's and FSDP2's hooks stay eager around it (levers/compile.py).
    compiled = (apply_compile(model, scope=cfg.compile_scope, mode=cfg.compile_mode, block_names=blocks,
                              device_type=strategy.device.type, memory_cap=cfg.memory_cap) if cfg.compile else None)
    model = strategy.wrap(model, precision, blocks, **offload.wrap_options())  # FSDP2's CPUOffloadPolicy
    offload.after_wrap(model)
    # zero1: each rank keeps the state of its partition only; the other strategies return it as it is.
    optimizer = strategy.shard_optimizer(make_optimizer(cfg.section("schedule"), precision.optimizer_params(model),
                                                        model=model))
    return Run(cfg=cfg, task=task, model=model, precision=precision, strategy=strategy, optimizer=optimizer,
               scheduler=make_scheduler(optimizer, cfg),
               checkpointed=checkpointed, batchnorm=bn, frozen=frozen, compiled=compiled,
               offload=offload if offload.plan.parts else None)
