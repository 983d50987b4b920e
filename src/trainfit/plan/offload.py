"""The price of offload, as the planner reads it: the rules live with the lever.

What each ``--offload`` part frees and costs under each strategy (bytes over the host link per optimizer
step, and seconds at a link's bandwidth), and which settings each strategy runs, are offload's own rules:
:mod:`trainfit.levers.offload_rules`, torch-free, read from the strategy's row. The planner imports them from
there (this module only names them for ``plan/``); nothing here restates them.

The planner calls :func:`offload_price` once per candidate plan and turns its ``reason`` into the plan's
reasons line ("offload: frees 42 GiB per device, costs 1.8 s/step over the host link").
"""

from __future__ import annotations

from trainfit.levers.offload_rules import (
    OFFLOAD_CHOICES,
    OffloadPrice,
    OffloadTraffic,
    offload_as_run,
    offload_choices,
    offload_price,
)

__all__ = ["OFFLOAD_CHOICES", "OffloadTraffic", "OffloadPrice", "offload_as_run", "offload_choices", "offload_price"]
