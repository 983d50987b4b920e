"""Parallelism strategies, one module each: single, ddp (+ zero1), zero (zero2, zero3 on FSDP2).

Which class a name builds follows from its row in :data:`trainfit.vocabulary.STRATEGIES`.
"""

from __future__ import annotations

import dataclasses

from trainfit.errors import ConfigError
from trainfit.strategies import process_group as pg
from trainfit.strategies.base import Strategy, unwrap
from trainfit.strategies.compat import resolve_accumulation
from trainfit.strategies.ddp import DDP, Zero1
from trainfit.strategies.single import Single
from trainfit.strategies.zero import FSDP
from trainfit.vocabulary import STRATEGIES, StrategyName, check_compatible, distributed_strategies

LAUNCH_HINT = "launch with `torchrun --nproc_per_node=N -m trainfit train ...` or `trainfit train --devices N`"


def make_strategy(cfg) -> Strategy:
    """Build the strategy named in the config; distributed ones use the existing process group.

    Raises:
        ConfigError: a distributed strategy without a process group, a single-device one in a group of
            several processes, or a precision the strategy cannot run.
    """
    world = pg.current()
    check_compatible(cfg.strategy, cfg.precision)
    facts = STRATEGIES[StrategyName(cfg.strategy)]
    if not facts.distributed:
        if world is not None and world.world_size > 1:
            raise ConfigError("strategy", cfg.strategy, distributed_strategies(),
                              f"{world.world_size} processes were launched; each would train its own copy")
        return Single(world.device if world else "cpu")
    if world is None:
        raise ConfigError("strategy", cfg.strategy, f"{StrategyName.SINGLE} without a process group",
                          f"strategy={cfg.strategy} needs a process group: {LAUNCH_HINT}")
    if facts.fsdp:
        return FSDP(world, facts=facts, grad_sync=cfg.grad_sync)
    return (Zero1 if facts.shards_optimizer_by_parameter else DDP)(world, grad_sync=cfg.grad_sync)


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


__all__ = ["Strategy", "Single", "make_strategy", "fit_to_world", "unwrap"]
