"""Test-only fault injection at the Task seam (the engine has no test branches).

A faulty task is the built-in tiny GPT task whose ``loss`` misbehaves on chosen optimizer
steps (1-based, counted from the start of this process's run):

* ``inf-grad``: the loss value is untouched, but its backward multiplies the incoming
  gradient by +inf -- every parameter gradient becomes inf/NaN while the loss stays
  finite, which is exactly what an fp16 overflow looks like to the step.
* ``nan-loss``: the loss value is NaN (so are its gradients).

Use :func:`patch_make_task` to make ``trainfit.run.build_run`` build faulty tasks in-process (it builds its
task through ``trainfit.tasks.make.task_of``, which calls ``trainfit.tasks.make.make_task``).
"""

from __future__ import annotations

import dataclasses

import torch


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


def faulty_task(task, *, bad_steps: set[int], kind: str, accumulation: int):
    """A copy of ``task`` whose loss is faulty on ``bad_steps`` (1-based optimizer steps)."""
    assert kind in ("inf-grad", "nan-loss")
    calls = {"n": 0}

    def loss(model, batch):
        step = calls["n"] // accumulation + 1  # one call per micro-batch, in order
        calls["n"] += 1
        loss_sum, count = task.loss(model, batch)
        if step in bad_steps:
            loss_sum = _InfGrad.apply(loss_sum) if kind == "inf-grad" else loss_sum * float("nan")
        return loss_sum, count

    return dataclasses.replace(task, loss=loss)


def patch_make_task(monkeypatch, *, bad_steps, kind: str, accumulation: int) -> None:
    import trainfit.tasks.make as tasks_mod

    real = tasks_mod.make_task

    def make(*a, **kw):
        return faulty_task(real(*a, **kw), bad_steps=set(bad_steps), kind=kind, accumulation=accumulation)

    monkeypatch.setattr(tasks_mod, "make_task", make)


def fp16_storm(model_config: str = "", seq_len: int = 16, seed: int = 0):
    """``module:callable`` factory for the CLI: the tiny GPT with infinite gradients in steps 3-7.

    ``trainfit train --model reliability.faults:fp16_storm`` (with ``tests`` on PYTHONPATH).
    """
    from trainfit.tasks.builtin import gpt_task

    task = gpt_task("gpt-tiny", seq_len=seq_len, seed=seed, dataset_size=4096, overrides=model_config)
    return faulty_task(task, bad_steps=set(range(3, 8)), kind="inf-grad", accumulation=2)
