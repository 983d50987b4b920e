"""Parallelism strategies: single, ddp, zero1, zero2, zero3."""

from __future__ import annotations

from trainfit.errors import ConfigError
from trainfit.strategies.base import Single, Strategy


def make_strategy(cfg) -> Strategy:
    """Build the strategy named in the config (distributed ones need a process group)."""
    if cfg.strategy == "single":
        return Single("cpu")
    raise ConfigError("strategy", cfg.strategy, ("single",), "distributed strategies are not built yet")


__all__ = ["Strategy", "Single", "make_strategy"]
