"""A front-door request: keyword arguments (or a RunConfig) -> a validated RunConfig, refused as the CLI refuses.

Every front-door function (``trainfit.front.memory``, ``.profile``, ``.train``) takes a ``config`` and/or the
RunConfig fields as keywords; :func:`config_of` builds the configuration and applies the refusals the command
line applies to flags (``commands/flags.py`` imports them from here): an ``accumulation`` that ``global_batch``
or ``micro_batch="auto"`` would change, and a setting that would be ignored (``compile_mode`` without
``compile``, ``text_field`` where no data has fields). Each refusal is one ConfigError line.
"""

from __future__ import annotations

import collections.abc
import functools
import importlib
import inspect
import logging
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

import trainfit.logs as logs
from trainfit.config import FIELDS, DataSection, DistributionSection, LeversSection, RunConfig, make_config
from trainfit.errors import ConfigError, TrainfitError, shown
from trainfit.tasks.corpus import find_sources
from trainfit.tasks.prepared import is_prepared
from trainfit.vocabulary import CheckpointPolicy


def config_of(config: RunConfig | None, fields: dict[str, Any], *, nodes: int = 1,
              ranks: int | None = None) -> RunConfig:
    """``config`` (default: the embedded job) with ``fields`` over it, checked like the CLI's flags: each keyword
    is a value the caller wrote, used as written or refused naming what disagrees with it.

    Raises:
        ConfigError: an unknown field, a bad value, or a combination the CLI refuses.
    """
    if config is not None and not isinstance(config, RunConfig):
        raise ConfigError("config", type(config).__name__, "a trainfit.config.RunConfig or None")
    cfg = make_config(dict(fields), base=config)
    refuse_conflicts(cfg, given={k: f"{k}={shown(v, 40)}" for k, v in fields.items()}, nodes=nodes, ranks=ranks)
    return cfg


def refuse_conflicts(cfg: RunConfig, *, given: Mapping[str, str] | set[str], nodes: int = 1,
                     ranks: int | None = None) -> None:
    """The refusals of fields the caller set explicitly (``given``: field -> where it was written, e.g.
    ``"--accumulation 3"``, ``"[levers] accumulation = 3 in job.toml"``, ``"accumulation=3"``; a set of fields
    reads as keywords): overridden (:func:`refuse_overridden`) or unused (:func:`refuse_unused`). The job's
    ranks: torchrun's WORLD_SIZE, else ``ranks`` where the caller counts them (``memory --devices``), else the
    config's devices x ``nodes``. The command line and the Python front door both ask here."""
    if not isinstance(given, Mapping):
        given = {k: f"{k}={shown(getattr(cfg, k), 40)}" for k in given}
    world = int(os.environ.get("WORLD_SIZE") or ranks or cfg.devices * nodes)
    refuse_overridden(cfg.section("distribution"), cfg.section("levers"), given=given, world=world)
    refuse_unused(cfg, given=set(given))


def refuse_overridden(dist: DistributionSection, levers: LeversSection, *, given: Mapping[str, str],
                      world: int) -> None:
    """An ``accumulation`` the user wrote that ``global_batch`` or ``micro_batch="auto"`` would change is refused
    naming both sources (a flag, a TOML key, a ``--from`` key or a keyword), not silently replaced: the triangle
    global_batch = micro_batch x accumulation x ranks has one derived corner, and only accumulation is derived."""
    if "accumulation" not in given:
        return
    mine = given["accumulation"]
    if levers.micro_batch == "auto":
        other = given.get("micro_batch", "micro_batch=auto")
        raise ConfigError("accumulation", levers.accumulation, "no accumulation with micro_batch auto",
                          f"{mine} and {other} disagree: auto-fit chooses the split of the global batch itself; "
                          "drop one")
    if dist.global_batch:
        if levers.micro_batch * levers.accumulation * world != dist.global_batch:
            derived = dist.global_batch / (levers.micro_batch * world)
            other = given.get("global_batch", f"global_batch={dist.global_batch}")
            raise ConfigError(
                "accumulation", levers.accumulation,
                f"global_batch / (micro_batch x ranks) = {dist.global_batch} / ({levers.micro_batch} x {world}) = "
                f"{derived:g}", f"{mine} and {other} disagree: give one, or values that agree")


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


# -- the front door's arguments ----------------------------------------------------------------------------------------
_RUN_TYPES: dict[str, tuple[type, ...]] = {}
"""Per RunConfig field, the Python types a keyword may hold besides text (text is parsed as the flag's is)."""


def _run_types(field: str) -> tuple[type, ...]:
    if not _RUN_TYPES:
        for name in FIELDS:
            default = getattr(RunConfig(), name)
            kind: tuple[type, ...] = (type(default),)
            if isinstance(default, float):
                kind = (int, float)
            elif isinstance(default, CheckpointPolicy):  # any policy object, or its spec as text
                kind = (CheckpointPolicy,)
            _RUN_TYPES[name] = (str, *kind)
    return _RUN_TYPES.get(field, ())


def check_arguments(name: str, fn: Any, args: tuple, kwargs: dict, *, fields: type = RunConfig) -> None:
    """The front door's arguments, before any work: they bind to ``fn``'s signature (an unknown keyword, a missing
    one or one too many is a ConfigError naming it, not Python's TypeError) and each holds a type its annotation
    or RunConfig field takes (``plan("str")``, ``train(model_config={...})``, ``prepare(data=123)``: refused
    in one line naming the argument, not an AttributeError from deep inside). ``fields``: the dataclass whose
    fields ``fn``'s ``**`` keywords are (RunConfig; PlanRequest for ``plan``)."""
    sig = inspect.signature(fn)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise ConfigError(f"trainfit.{name}", "(the arguments)", "its documented arguments: " + ", ".join(
            p for p in sig.parameters if sig.parameters[p].kind is not inspect.Parameter.VAR_KEYWORD), str(e))
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve here: bind-checked only
        hints = {}
    for key, value in bound.arguments.items():
        param = sig.parameters[key]
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            for field, v in value.items():
                _check_field(fields, field, v)
        elif key in hints and not _holds(hints[key], value):
            raise ConfigError(key, value, _type_words(hints[key]), f"the {key} argument of trainfit.{name}")


def _check_field(fields: type, field: str, value: Any) -> None:
    if fields is not RunConfig:
        hint = _field_hints(fields).get(field)
        if hint is not None and not _holds(hint, value):
            raise ConfigError(field, value, _type_words(hint), f"a {fields.__name__} field")
        return
    kinds = _run_types(field)
    if kinds and (isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds)):
        words = " or ".join(dict.fromkeys("text" if k is str else getattr(k, "__name__", "a policy object")
                                          for k in kinds))
        raise ConfigError(field, value, f"{words} (a RunConfig field)", f"got {type(value).__name__}")


@functools.cache
def _field_hints(fields: type) -> dict[str, Any]:
    """A dataclass's field annotations, resolved once (``PlanRequest``'s, for ``plan``'s keywords)."""
    return typing.get_type_hints(fields)


def _holds(hint: Any, value: Any) -> bool:
    """Whether ``value`` is of the annotated type (unions, Optional, Literal, Sequence[...]; anything more
    elaborate is taken, and left to the function's own checks)."""
    origin = typing.get_origin(hint)
    if hint is Any or hint is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_holds(h, value) for h in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin in (tuple, list, collections.abc.Sequence):
        return isinstance(value, (tuple, list)) and all(_holds(typing.get_args(hint)[0], v) for v in value)
    if isinstance(hint, type):
        if hint is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        if hint is int:
            return isinstance(value, int) and not isinstance(value, bool)
        if hint is str:  # a path as a Path object reads as its text
            return isinstance(value, (str, os.PathLike))
        return isinstance(value, hint)
    return True


def _type_words(hint: Any) -> str:
    text = str(hint).replace("typing.", "").replace("NoneType", "None")
    return "a value of type " + (hint.__name__ if isinstance(hint, type) else text)


# -- the front door's calls --------------------------------------------------------------------------------------------
def front_door(name: str, fn: Any) -> Any:
    """``fn`` (``trainfit.<name>``) as the package exposes it: its arguments checked first (:func:`check_arguments`:
    only a ConfigError for bad input of any type), and what it logs (the ``trainfit`` logger) or writes on stderr
    held until the job is accepted (``logs.accept``) -- dropped when it is refused, so a refusal is the error alone
    (the command line holds its stderr the same way, ``cli.HELD``)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        check_arguments(name, fn, args, kwargs, fields=_fields_of(name))
        log = _HeldLog()
        try:
            with logs.held_until_accepted(dropped_on=(TrainfitError,)):
                return fn(*args, **kwargs)
        except TrainfitError:
            log.release(show=False)
            raise
        finally:
            log.release(show=True)

    return call


def _fields_of(name: str) -> type:
    """The dataclass whose fields a front-door function takes as ``**`` keywords."""
    if name == "plan":  # the planner's request; imported when planned, as trainfit.plan does
        return importlib.import_module("trainfit.front.plan_request").PlanRequest
    return RunConfig


class _HeldLog:
    """The ``trainfit`` logger's records while a front-door job is not yet accepted (``logs.holding()``): kept from
    the user's handlers; said, in order, once the job is accepted (at the next record) or the call ends; dropped on
    a refusal."""

    def __init__(self) -> None:
        self.root, self.records, self.holding = logging.getLogger("trainfit"), [], True
        self.handler = logging.Handler()
        self.handler.emit = self._emit  # type: ignore[method-assign]
        self.before = self.root.propagate, self.root.handlers[:]
        self.root.propagate, self.root.handlers[:] = False, [self.handler]

    def _emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if not logs.holding():  # accepted: say what was held, and this, and let the rest through
            self.release(show=True)

    def release(self, *, show: bool) -> None:
        if not self.holding:
            return
        self.holding = False
        self.root.propagate, self.root.handlers[:] = self.before[0], self.before[1]
        for record in self.records if show else ():
            logging.getLogger(record.name).handle(record)
        self.records = []
