"""Parallelism strategies: single, ddp, zero1, zero2, zero3."""

from __future__ import annotations

import dataclasses

from trainfit.errors import ConfigError
from trainfit.strategies.base import Single, Strategy
from trainfit.strategies.compat import DISTRIBUTED, check_precision, resolve_accumulation

_LAUNCH_HINT = "launch with `torchrun --nproc_per_node=N -m trainfit train ...` or `trainfit train --nproc N`"


def make_strategy(cfg) -> Strategy:
    """Build the strategy named in the config; distributed ones use the existing process group.

    Raises:
        ConfigError: a distributed strategy without a process group, ``single`` in a group of
            several processes, or a precision the strategy cannot run.
    """
    from trainfit.strategies import process_group as pg

    world = pg.current()
    check_precision(cfg.strategy, cfg.precision)
    if cfg.strategy == "single":
        if world is not None and world.world_size > 1:
            raise ConfigError("strategy", "single", DISTRIBUTED,
                              f"{world.world_size} processes were launched; each would train its own copy")
        return Single(world.device if world else "cpu")
    if world is None:
        raise ConfigError("strategy", cfg.strategy, "single without a process group",
                          f"strategy={cfg.strategy} needs a process group: {_LAUNCH_HINT}")
    if cfg.strategy in ("ddp", "zero1"):
        from trainfit.strategies.ddp import DDP, Zero1

        return (DDP if cfg.strategy == "ddp" else Zero1)(world, grad_sync=cfg.grad_sync)
    if cfg.strategy in ("zero2", "zero3"):
        from trainfit.strategies.zero import FSDP

        return FSDP(world, name=cfg.strategy, grad_sync=cfg.grad_sync)
    raise ConfigError("strategy", cfg.strategy, ("single", *DISTRIBUTED))


def fit_to_world(cfg, world_size: int):
    """The config with each rank's accumulation derived from ``global_batch`` (unchanged when it is 0).

    Raises:
        ConfigError: the world size does not divide the global batch into whole micro-batches.
    """
    if not cfg.global_batch or cfg.micro_batch == "auto":
        return cfg
    acc = resolve_accumulation(global_batch=cfg.global_batch, micro_batch=cfg.micro_batch,
                               accumulation=cfg.accumulation, world_size=world_size)
    return dataclasses.replace(cfg, accumulation=acc)


__all__ = ["Strategy", "Single", "make_strategy", "fit_to_world"]
