"""The default schedule (constant, no warm-up) steps without LambdaLR's walk over the groups: the same lr
and the same scheduler state as torch's own ``LambdaLR`` stepped alongside, skipped steps and a resume too."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from trainfit.config import RunConfig
from trainfit.levers.schedule import advance, make_scheduler, restore_scheduler


def _pair(cfg: RunConfig):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    ours = torch.optim.AdamW([{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias]}], lr=cfg.lr)
    ref = torch.optim.AdamW([{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias]}], lr=cfg.lr)
    return ours, make_scheduler(ours, cfg), ref, LambdaLR(ref, lambda step: 1.0)


def _state(s) -> dict:
    return {k: v for k, v in s.state_dict().items() if k != "lr_lambdas"}


@pytest.mark.parametrize("pattern", [[True] * 7, [False, True, False, False, True, True, False]])
def test_flat_schedule_state_equals_torchs_lambdalr(pattern):
    cfg = RunConfig(lr=2e-3)
    ours, sched, ref, ref_sched = _pair(cfg)
    assert type(sched) is not LambdaLR  # the fast path is the one under test
    for stepped in pattern:
        if stepped:
            ours.step()
            ref.step()
        advance(sched, stepped=stepped)
        advance(ref_sched, stepped=stepped)
        assert _state(sched) == _state(ref_sched)
        assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in ref.param_groups] == [2e-3, 2e-3]
        assert sched.get_last_lr() == ref_sched.get_last_lr()


def test_flat_schedule_resumes_like_torchs():
    cfg = RunConfig(lr=2e-3)
    ours, sched, ref, ref_sched = _pair(cfg)
    for _ in range(3):
        ours.step()
        advance(sched, stepped=True)
        ref.step()
        advance(ref_sched, stepped=True)
    saved = sched.state_dict()
    _, sched2, _, _ = _pair(cfg)
    restore_scheduler(sched2, saved, next_step=3)
    advance(sched2, stepped=True)
    advance(ref_sched, stepped=True)
    assert _state(sched2) == _state(ref_sched) and sched2.last_epoch == 4


def test_other_schedules_are_torchs_lambdalr():
    for cfg in (RunConfig(warmup_steps=2), RunConfig(schedule="cosine"), RunConfig(schedule="linear")):
        assert type(make_scheduler(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=cfg.lr), cfg)) is LambdaLR
