"""run.build_run then Run.step against plain PyTorch, and a Run's state round trip."""

import copy

import pytest
import torch
from torch.nn import functional as F

from trainfit.config import make_config
from trainfit.data import rank_micro_batches
from trainfit.run import build_run
from trainfit.tasks.synthetic import IGNORE_INDEX

VALUES = {"model_config": "n_layer=1,d_model=32,n_head=2", "seq_len": 16, "micro_batch": 2, "accumulation": 3,
          "dataset_size": 64, "optimizer": "sgd", "lr": 0.2, "grad_clip": 0.7}


def _step_batches(run, step: int) -> list[dict]:
    cfg = run.cfg
    ds = run.task.dataset()
    idx = rank_micro_batches(step, micro_batch=cfg.micro_batch, accumulation=cfg.accumulation, rank=0, world_size=1,
                             dataset_size=len(ds), seed=cfg.seed)
    return [run.task.collate([ds[i] for i in mb]) for mb in idx]


def test_build_run_then_step_equals_plain_torch():
    run = build_run(make_config(VALUES))
    model = copy.deepcopy(run.model)  # the same initial weights, stepped by hand below
    opt = torch.optim.SGD(model.parameters(), lr=VALUES["lr"], momentum=0.9)
    for step in range(3):
        batches = _step_batches(run, step)
        res = run.step(batches)
        # the micro-batches are padded to their own longest sequence: the loss is summed over them by hand
        count = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
        loss = sum(F.cross_entropy(model(b["input_ids"]).flatten(0, 1), b["labels"].flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum") for b in batches) / count
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), VALUES["grad_clip"])
        opt.step()
        opt.zero_grad()
        assert res.stepped and res.count == count
        assert res.loss == pytest.approx(float(loss.detach()), rel=1e-5)
        assert res.grad_norm == pytest.approx(float(norm), rel=1e-4)
    for (name, p), q in zip(run.model.named_parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


def test_state_then_restore_continues_the_same_steps():
    a = build_run(make_config({**VALUES, "optimizer": "adamw", "lr": 1e-2}))
    a.step(_step_batches(a, 0))
    state = copy.deepcopy(a.state(1))
    b = build_run(make_config({**VALUES, "optimizer": "adamw", "lr": 1e-2, "seed": 0}))
    assert b.restore(state, path=None) == 1
    for step in (1, 2):
        ra, rb = a.step(_step_batches(a, step)), b.step(_step_batches(b, step))
        assert ra.loss == rb.loss and ra.grad_norm == rb.grad_norm
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), name
