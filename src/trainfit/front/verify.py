"""``trainfit verify`` as library calls: one step of the configured levers (or of another tool) against the
fp32 big-batch reference.

    from trainfit.front.verify import verify, verify_framework
    r = verify(model="gpt-tiny", precision="bf16-mixed", micro_batch=2, accumulation=4)
    r.passed, r.grad_rel_error, r.causes

    r = verify_framework(model="hf:./ckpt", data="train.csv", micro_batch=2, accumulation=4,
                         framework="hf-trainer", collator="transformers:DataCollatorWithPadding",
                         from_file="training_args.json")
    r.accumulation_error.found, r.normalisation.rel_error, r.accumulation_error.fix

Each takes a :class:`~trainfit.config.RunConfig` and/or its fields as keywords (checked as the CLI checks its
flags), and ``from_file``: a transformers TrainingArguments JSON, an accelerate config YAML or Lightning Trainer
arguments, whose batch settings apply where no keyword gives them (with ``framework="hf-trainer"`` the Trainer runs
with those TrainingArguments). What they do is said at INFO on the ``trainfit.verify`` logger.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainfit.config import RunConfig
from trainfit.errors import ConfigError
from trainfit.front.request import config_of
from trainfit.integrations.frameworks import FROM_FORMATS, FrameworkVerifyReport
from trainfit.integrations.frameworks import verify_framework as verify_framework_step
from trainfit.integrations.read_config import RUN_KEYS, TOOL_LABELS, file_values, load_mapping, read_from
from trainfit.probes.verify import verify as verify_step
from trainfit.progress import logger
from trainfit.results import VerifyReport

log = logger("verify")


@dataclass(frozen=True, kw_only=True)
class FromFile:
    """What ``--from FILE`` gives a verify call."""

    overrides: dict[str, Any]
    """RunConfig fields the file sets and no flag or keyword gave."""
    user_args: Mapping[str, Any] | None
    """hf-trainer: the raw TrainingArguments mapping the Trainer runs with."""
    lines: tuple[str, ...]
    """What was read, overridden and not applied (``trainfit: ...`` lines)."""


def read_from_file(path: str | None, framework: str | None, given: Mapping[str, Any]) -> FromFile:
    """``--from FILE`` for verify: the file's run settings not in ``given`` (flags or keywords override it), the
    TrainingArguments for hf-trainer, and lines saying what was read.

    Raises:
        ConfigError: an unreadable file, or one of another tool than ``framework`` reads.
    """
    if not path:
        return FromFile(overrides={}, user_args=None, lines=())
    found = read_from(path)
    if framework is not None and found.tool != FROM_FORMATS[framework]:
        raise ConfigError("from", path, f"a {TOOL_LABELS[FROM_FORMATS[framework]]} file with --framework "
                          f"{framework}", f"its keys are {TOOL_LABELS[found.tool]}")
    applied, overridden = file_values(found, {k: given.get(k) for k in RUN_KEYS})
    keys = ("micro_batch", "accumulation") if framework else RUN_KEYS  # the tool runs fp32, one process
    unused = [f"{k}={v}" for k, v in applied.items() if k not in keys]
    lines = [*found.lines(overridden)]
    if unused:
        why = "the check runs in fp32, in one process" if framework else "ranks come from torchrun"
        lines.append(f"trainfit: not applied from {path}: {', '.join(unused)} ({why})")
    return FromFile(overrides={k: v for k, v in applied.items() if k in keys},
                    user_args=load_mapping(path) if framework == "hf-trainer" else None, lines=tuple(lines))


def _config(config: RunConfig | None, fields: dict[str, Any], from_file: str | None,
            framework: str | None) -> tuple[RunConfig, FromFile]:
    read = read_from_file(from_file, framework, fields)
    cfg = config_of(config, {**read.overrides, **fields})
    for line in read.lines:
        log.info(line.removeprefix("trainfit: "))
    return cfg, read


def verify(config: RunConfig | None = None, *, from_file: str | None = None, **fields: Any) -> VerifyReport:
    """Step the configured levers once (as ``trainfit train`` builds them) and compare the gradient and the update
    with the fp32 big-batch reference in plain PyTorch (``trainfit verify``).

    Raises:
        ConfigError: a bad field, ``micro_batch="auto"``, an unreadable ``from_file`` (one line).
        TrainfitError: the model does not build the same initial weights twice.
    """
    cfg, _ = _config(config, fields, from_file, None)
    return verify_step(cfg)


def verify_framework(config: RunConfig | None = None, *, framework: str, loss: str = "default",
                     collator: str = "", trainer: str = "", from_file: str | None = None,
                     user_args: Mapping[str, Any] | None = None, settings: tuple[str, ...] = (),
                     **fields: Any) -> FrameworkVerifyReport:
    """Run ``framework``'s own optimizer step (hf-trainer, accelerate, lightning) with accumulation and without,
    and report its accumulation error apart from its normalisation difference (``trainfit verify --framework``).

    Args:
        collator, trainer: hf-trainer: ``module:callable`` of the user's data collator and Trainer subclass.
        from_file: the tool's own settings file (``--from``); with hf-trainer its TrainingArguments are used.
        user_args, settings: the TrainingArguments and the lines already read from a file (the CLI reads
            ``--from`` itself, to echo it before the run); not with ``from_file``.

    Raises:
        ConfigError: a bad field or combination, a tool not installed, a model the tool cannot train, a row
            missing a field its head needs; a fault in the user's own code -- a collator that raises or returns
            rows the model cannot take (``field`` "collator"), a model whose forward raises ("model"), a
            Trainer subclass whose compute_loss raises or returns no single differentiable number ("trainer")
            -- each in one line naming the object.
    """
    if from_file and (user_args is not None or settings):
        raise ConfigError("from_file", from_file, "no user_args or settings with it", "give one or the other")
    cfg, read = _config(config, fields, from_file, framework)
    if from_file:
        user_args, settings = read.user_args, tuple(ln.removeprefix("trainfit: ") for ln in read.lines)
    return verify_framework_step(cfg, framework=framework, loss=loss, user_args=user_args, settings=settings,
                                 collator=collator, trainer=trainer)


__all__ = ["verify", "verify_framework", "read_from_file", "FromFile"]
