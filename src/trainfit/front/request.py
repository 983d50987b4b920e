"""A front-door request: keyword arguments (or a RunConfig) -> a validated RunConfig, refused as the CLI refuses.

Every front-door function (``trainfit.front.memory``, ``.profile``, ``.train``) takes a ``config`` and/or the
RunConfig fields as keywords; :func:`config_of` builds the configuration and applies the refusals the command
line applies to flags (``commands/flags.py`` imports them from here): an ``accumulation`` that ``global_batch``
or ``micro_batch="auto"`` would change, and a setting that would be ignored (``compile_mode`` without
``compile``, ``text_field`` where no data has fields). Each refusal is one ConfigError line.
"""

from __future__ import annotations

import os
from typing import Any

from trainfit.config import DataSection, DistributionSection, LeversSection, RunConfig, make_config
from trainfit.errors import ConfigError
from trainfit.tasks.corpus import find_sources
from trainfit.tasks.prepared import is_prepared


def config_of(config: RunConfig | None, fields: dict[str, Any]) -> RunConfig:
    """``config`` (default: the embedded job) with ``fields`` over it, checked like the CLI's flags.

    Raises:
        ConfigError: an unknown field, a bad value, or a combination the CLI refuses.
    """
    if config is not None and not isinstance(config, RunConfig):
        raise ConfigError("config", type(config).__name__, "a trainfit.config.RunConfig or None")
    cfg = make_config(dict(fields), base=config)
    refuse_conflicts(cfg, given=set(fields))
    return cfg


def refuse_conflicts(cfg: RunConfig, *, given: set[str]) -> None:
    """The refusals of fields the caller set explicitly (``given``): overridden (:func:`refuse_overridden`) or
    unused (:func:`refuse_unused`). The command line and the Python front door both ask here."""
    refuse_overridden(cfg.section("distribution"), cfg.section("levers"), given=given)
    refuse_unused(cfg, given=given)


def refuse_overridden(dist: DistributionSection, levers: LeversSection, *, given: set[str]) -> None:
    """An explicit ``accumulation`` that ``global_batch`` or ``micro_batch="auto"`` would change is refused,
    not silently replaced."""
    if "accumulation" not in given:
        return
    if levers.micro_batch == "auto":
        raise ConfigError("accumulation", levers.accumulation, "no --accumulation with --micro-batch auto",
                          "auto-fit chooses the split of --global-batch itself")
    if dist.global_batch:
        world = int(os.environ.get("WORLD_SIZE") or dist.devices)
        if levers.micro_batch * levers.accumulation * world != dist.global_batch:
            derived = dist.global_batch / (levers.micro_batch * world)
            raise ConfigError(
                "accumulation", levers.accumulation,
                f"global_batch / (micro_batch x ranks) = {dist.global_batch} / ({levers.micro_batch} x {world}) = "
                f"{derived:g}", "give --global-batch or --accumulation, not two that disagree")


def refuse_unused(cfg: RunConfig, *, given: set[str]) -> None:
    """A setting that would be ignored is refused, naming why: ``--compile-mode``/``--compile-scope`` without
    ``--compile on``, ``--text-field`` where no data has fields (text files, a prepared directory, no --data)."""
    default = RunConfig()
    for key in ("compile_mode", "compile_scope"):
        if not cfg.compile and (key in given or getattr(cfg, key) != getattr(default, key)):
            raise ConfigError(key, getattr(cfg, key), "a setting of --compile on",
                              "torch.compile is off, so it would be ignored: add --compile on, or drop it")
    if "text_field" in given or cfg.text_field != default.text_field:
        why = _no_fields(cfg.section("data"))
        if why:
            raise ConfigError("text_field", cfg.text_field, "a setting of JSON Lines, Parquet or CSV data",
                              f"{why}, so it would be ignored: drop it")


def _no_fields(data: DataSection) -> str:
    """Why ``--text-field`` applies to none of the run's data ("" when some source has fields)."""
    named = {f: p for f, p in (("data", data.data), ("val_data", data.val_data)) if p}
    if not named:
        return "no --data is given (the generated data has no fields)"
    for field, p in named.items():
        if not is_prepared(p) and any(s.kind != "text" for s in find_sources(p, field=field).files):
            return ""
    paths = list(named.values())
    kinds = ["a prepared directory (its fields were read by trainfit prepare)" if is_prepared(p) else
             "text files (one document per file)" for p in paths]
    return f"{' and '.join(paths)} {'are' if len(paths) > 1 else 'is'} {' and '.join(dict.fromkeys(kinds))}"
