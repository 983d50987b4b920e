"""Phase timers threaded through the engine step.

The engine calls ``with timer.phase("forward"): ...``. By default the timer is
:data:`NULL_TIMER`, whose phase is one shared no-op context: the step does not know it is
measured and pays two attribute look-ups per phase. :class:`PhaseTimer` records *exclusive*
time per phase (a nested phase, e.g. a collective inside the optimizer phase, is subtracted
from its parent) with ``time.perf_counter`` on CPU, and with CUDA events on a CUDA device,
so that phases are placed on the device's timeline without a host-device sync inside the step.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Protocol

import torch

_NULL_CONTEXT = contextlib.nullcontext()


class Timer(Protocol):
    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """Context around one phase of the step."""


class NullTimer:
    """Measures nothing (the engine's default)."""

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return _NULL_CONTEXT


NULL_TIMER = NullTimer()


class _Phase:
    __slots__ = ("timer", "name", "index")

    def __init__(self, timer: PhaseTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        t = self.timer
        self.index = len(t._entries)
        parent = t._stack[-1] if t._stack else -1
        t._entries.append([self.name, parent, t._mark(), None])
        t._stack.append(self.index)

    def __exit__(self, *exc) -> None:
        t = self.timer
        t._entries[self.index][3] = t._mark()
        t._stack.pop()


class PhaseTimer:
    """Exclusive seconds per phase name, collected once per step.

    Args:
        device: where the step runs; CUDA devices are timed with CUDA events.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._entries: list[list] = []
        self._stack: list[int] = []

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _elapsed(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return _Phase(self, name)

    def collect(self) -> dict[str, float]:
        """Exclusive seconds per phase since the last collect, then reset.

        On CUDA this synchronizes the device (host-device sync): call it after the step.
        """
        assert not self._stack, f"collect() inside open phases {self._stack}"
        if self.cuda and self._entries:
            torch.cuda.synchronize()
        total = [self._elapsed(e[2], e[3]) for e in self._entries]
        out: dict[str, float] = defaultdict(float)
        for i, (name, parent, _, _) in enumerate(self._entries):
            out[name] += total[i]
            if parent >= 0:
                out[self._entries[parent][0]] -= total[i]
        self._entries.clear()
        return dict(out)
