"""trainfit: make a PyTorch training run fit in memory and scale -- measuring first.

The front door: one function per command, typed request in, typed report out (``docs/python.md``)::

    import trainfit
    report = trainfit.plan(model="gpt-small", global_batch=64, device_memory="24GiB", device="a100", devices=4)
    mem = trainfit.estimate_memory(model="gpt-tiny", micro_batch=8)     # or measure_memory(...)
    trainfit.profile(...), trainfit.verify(...), trainfit.train(...), trainfit.prepare(...)

The public names below are imported on first use (PEP 562), so ``import trainfit`` and the command line
pay for the step and its strategies (``torch.distributed.tensor`` among them, about a second) only when
they use them: a cached ``trainfit plan`` answers without them.

``trainfit.plan`` and ``trainfit.train`` are also the names of the planner's package and the training loop's
module. Both stay importable as before (``import trainfit.plan.search``); the module object is callable and
calls the front door (``trainfit.plan(...)`` is ``trainfit.front.plan.plan(...)``). This is done here, at the
top of the layers, by the package's own attribute hook: when the import system binds one of those
submodules onto the package, its module object gets a class whose ``__call__`` is the front-door function.
"""

from __future__ import annotations

import importlib
import sys
import types

__version__ = "0.1.0"

_HOMES = {
    # the front door (trainfit.front): what the commands call
    "plan": "trainfit.front.plan", "PlanRequest": "trainfit.front.plan",
    "estimate_memory": "trainfit.front.memory", "measure_memory": "trainfit.front.memory",
    "profile": "trainfit.front.profile",
    "verify": "trainfit.front.verify", "verify_framework": "trainfit.front.verify",
    "train": "trainfit.front.train", "prepare": "trainfit.front.prepare",
    # their typed reports and the config
    "PlanReport": "trainfit.results", "PlanRow": "trainfit.results", "MemoryReport": "trainfit.results",
    "ProfileReport": "trainfit.results", "VerifyReport": "trainfit.results", "TrainSummary": "trainfit.results",
    "PrepareReport": "trainfit.results", "RunConfig": "trainfit.config",
    # the step and its levers, for a loop of your own
    "optimizer_step": "trainfit.engine", "StepResult": "trainfit.engine",
    "make_precision": "trainfit.levers.precision", "apply_checkpointing": "trainfit.levers.checkpointing",
    "parse_checkpoint_policy": "trainfit.levers.checkpointing",
}
__all__ = sorted(_HOMES)

_SHADOWED = {"trainfit.plan": "plan", "trainfit.train": "train"}
"""Submodules whose name is also a front-door function's: their module object calls the function."""


_FUNCTIONS = ("plan", "estimate_memory", "measure_memory", "profile", "verify", "verify_framework", "train",
              "prepare")
"""The front-door functions: each call is checked at the door and says nothing until its job is accepted."""


def _front_door(name: str, fn):
    """``fn`` checked at the door and quiet until its job is accepted (``trainfit.front.request.front_door``)."""
    return importlib.import_module("trainfit.front.request").front_door(name, fn)


class _FrontDoorModule(types.ModuleType):
    """A submodule (``trainfit.plan``, ``trainfit.train``) that is also its front-door function when called."""

    def __call__(self, *args, **kwargs):
        name = _SHADOWED[self.__name__]
        return _front_door(name, getattr(importlib.import_module(_HOMES[name]), name))(*args, **kwargs)


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and _SHADOWED.get(getattr(value, "__name__", "")) == name \
                and type(value) is types.ModuleType:
            value.__class__ = _FrontDoorModule  # the import system binding the submodule: make it callable
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'trainfit' has no attribute {name!r}")
    if f"{__name__}.{name}" in _SHADOWED:  # the submodule, bound callable by _Package.__setattr__
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module(home), name)
    if name in _FUNCTIONS:
        value = _front_door(name, value)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
