"""Measurement: memory (measured and estimated), and the other meters of a step.

Memory API (the step does not know it is measured):

- :func:`measure_memory` -- one real optimizer step, every live storage classified.
- :func:`estimate_memory` -- the same step under fake tensors, nothing allocated.
- :func:`fit_batch_scaling` -- activations = fixed + per-sample x batch, and the largest
  micro-batch that fits a budget.
- :class:`MemoryTracker` / :func:`memory_cap` -- the dispatch-mode tracker, and a cheap
  cap that raises ``torch.OutOfMemoryError`` (auto-fit's CPU stand-in for a device limit).

Imports are lazy so that ``import trainfit.measure`` stays cheap for the other meters.
"""

from __future__ import annotations

_LAZY = {
    "measure_memory": "trainfit.measure.memory",
    "memory_cap": "trainfit.measure.tracker",
    "MemoryTracker": "trainfit.measure.tracker",
    "MemoryReport": "trainfit.measure.report",
    "estimate_memory": "trainfit.measure.estimate",
    "fit_batch_scaling": "trainfit.measure.scaling",
    "BatchScaling": "trainfit.measure.scaling",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = list(_LAZY)
