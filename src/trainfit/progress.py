"""What a long command is doing, said on stderr through the standard :mod:`logging` module.

Every message goes through a child of the ``trainfit`` logger (``trainfit.plan``, ``trainfit.memory``,
``trainfit.profile``, ``trainfit.train``, ...): ``log = progress.logger("memory")`` at the top of a module, then
``log.info("memory: measuring ...")``. The text names its command or probe itself (``plan: ...``); the CLI's
handler (:func:`to_stderr`) adds ``trainfit: `` in front, as every other info line of trainfit has.

Library default: the ``trainfit`` logger has a :class:`logging.NullHandler`, so nothing is printed from Python
unless the user configures logging (``logging.basicConfig(level=logging.INFO)``, or a handler on
``logging.getLogger("trainfit")``); ``logging.getLogger("trainfit").setLevel(logging.WARNING)`` silences it, bars
included (:func:`bars_enabled`).

A loop over items (the plan's traced pairs, profile's steps, verify's runs) is a :func:`stage`: one INFO line per
item, rate-limited (the first and the last item always, the others at most one per ``every_s`` seconds; the rest at
DEBUG), so a fast loop does not flood. Inside a stage, :func:`say` demotes the INFO lines of the work it calls
to DEBUG (a plan that measures four memory reports per pair says the pair, not each report); ``--verbose`` shows
them.

The CLI (``trainfit.cli.main``) installs :func:`to_stderr` for the command's duration: a handler that writes to
the *current* ``sys.stderr`` when a record is emitted, so ``trainfit.logs.held_until_accepted`` holds what is said
before a job is accepted (a refusal stays one line) like any other write to stderr.

Standard library only (layer 0): every layer may say what it does.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import time
from collections.abc import Iterator

ROOT = "trainfit"
"""The name of the logger every message goes through (children: ``trainfit.<probe>``)."""

logging.getLogger(ROOT).addHandler(logging.NullHandler())  # a library prints nothing unless configured

QUIET, NORMAL, VERBOSE = logging.WARNING, logging.INFO, logging.DEBUG
"""The CLI's levels: ``--quiet`` (warnings and errors), the default (progress and info), ``--verbose`` (debug)."""

_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("trainfit_progress_depth", default=0)
"""How many stages are open around this code: inside one, :func:`say`'s INFO lines are DEBUG."""


def logger(name: str = "") -> logging.Logger:
    """``trainfit.<name>`` (``trainfit`` itself for an empty name)."""
    return logging.getLogger(f"{ROOT}.{name}" if name else ROOT)


def say(log: logging.Logger, message: str, *args) -> None:
    """``log.info`` outside any :func:`stage`, ``log.debug`` inside one (its item line already says it)."""
    log.log(NORMAL if _DEPTH.get() == 0 else VERBOSE, message, *args)


def info(name: str, line: str) -> None:
    """An info line of a command (``trainfit.<name>`` at INFO): the CLI says it as ``trainfit: <line>`` on stderr,
    ``--quiet`` drops it, a library user routes it with ``logging``. A leading ``trainfit: `` is not repeated."""
    say(logger(name), line.removeprefix("trainfit: "))


def bars_enabled() -> bool:
    """THE switch every progress bar (tqdm) of trainfit obeys: a bar is drawn with ``disable=not bars_enabled()``
    (or a ``progress=`` argument computed from it), never with a constant. No bar when the ``trainfit`` logger is
    set above INFO (``--quiet``, which the ranks ``train --devices N`` starts inherit through
    ``$TRAINFIT_VERBOSITY``, or a user's ``setLevel(logging.WARNING)``), and none on a rank other than 0 (each
    rank would draw the same bar). An unconfigured logger keeps the bars a library call always drew."""
    level = logging.getLogger(ROOT).level
    return (level == logging.NOTSET or level <= NORMAL) and os.environ.get("RANK", "0") in ("", "0")


class Stage:
    """One loop of ``total`` items, said as ``<name>: <verb> <i>/<total> (<detail>)`` (see :func:`stage`); a verb
    in -ing (``tracing pair``) says an item that starts and ends its line with `` ...``, another (``traced pair``)
    one that has ended. Made inside another stage, its lines are DEBUG."""

    def __init__(self, log: logging.Logger, name: str, total: int, *, verb: str, every_s: float) -> None:
        self.log, self.name, self.total, self.verb, self.every_s = log, name, total, verb, every_s
        self.done = 0
        self.t0 = time.perf_counter()
        self.nested = _DEPTH.get() > 0
        self._last: float | None = None  # when the last INFO line was said

    def step(self, detail: str = "") -> None:
        """Item ``done + 1``: said at INFO when it is the first or the last, or ``every_s`` seconds after the last
        INFO line; at DEBUG otherwise (and always when the stage is nested)."""
        self.done += 1
        now = time.perf_counter()
        shown = not self.nested and (self.done in (1, self.total) or self._last is None
                                     or now - self._last >= self.every_s)
        if shown:
            self._last = now
        ongoing = self.verb.split()[0].endswith("ing") if self.verb.strip() else False
        text = (f"{self.name}: {self.verb} {self.done}/{self.total}" + (f" ({detail})" if detail else "")
                + (" ..." if ongoing else ""))
        self.log.log(NORMAL if shown else VERBOSE, text)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


@contextlib.contextmanager
def stage(name: str, total: int, *, verb: str = "step", log: logging.Logger | None = None,
          every_s: float = 1.0) -> Iterator[Stage]:
    """A loop over ``total`` items of the work ``name`` (``plan``, ``profile``, ...), each said by
    :meth:`Stage.step`: ``with progress.stage("plan", 8, verb="tracing pair") as s: ... s.step("bf16-mixed, full")``
    says ``plan: tracing pair 3/8 (bf16-mixed, full) ...``. Lines said by the work inside (:func:`say`) are DEBUG;
    a stage inside a stage says its items at DEBUG too."""
    s = Stage(log or logger(name), name, total, verb=verb, every_s=every_s)
    token = _DEPTH.set(_DEPTH.get() + 1)
    try:
        yield s
    finally:
        _DEPTH.reset(token)


@contextlib.contextmanager
def inner() -> Iterator[None]:
    """Work done on behalf of a line already said: :func:`say` inside the block is DEBUG (as inside a stage)."""
    token = _DEPTH.set(_DEPTH.get() + 1)
    try:
        yield
    finally:
        _DEPTH.reset(token)


class StderrHandler(logging.Handler):
    """Writes ``trainfit: <message>`` (``trainfit: warning: ...`` / ``trainfit: error: ...`` at those levels) to the
    ``sys.stderr`` of the moment the record is emitted -- not the stream of the moment it was made -- so a held
    stderr (``trainfit.logs``) or a test's capture receives it. One line per record."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = " ".join(self.format(record).splitlines()) or record.levelname.lower()
            kind = "error: " if record.levelno >= logging.ERROR else "warning: " if record.levelno >= logging.WARNING \
                else ""
            stream = sys.stderr
            stream.write(f"trainfit: {kind}{text}\n")
            stream.flush()
        except Exception:  # noqa: BLE001 -- logging's own rule: a failing handler never breaks the program
            self.handleError(record)


@contextlib.contextmanager
def to_stderr(level: int = NORMAL) -> Iterator[StderrHandler]:
    """For the duration of the block: the ``trainfit`` logger at ``level``, said on stderr by a
    :class:`StderrHandler` (and not passed on to the root logger's handlers, which would say it twice). The
    logger's level, its propagation and its handlers are restored after."""
    root = logging.getLogger(ROOT)
    handler = StderrHandler(level)
    before = root.level, root.propagate
    root.setLevel(level)
    root.propagate = False
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(before[0])
        root.propagate = before[1]


__all__ = ["ROOT", "QUIET", "NORMAL", "VERBOSE", "logger", "say", "info", "stage", "Stage", "inner", "bars_enabled",
           "StderrHandler", "to_stderr"]
