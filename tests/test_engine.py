"""engine.optimizer_step and engine.evaluate against a hand-written PyTorch loop (no trainfit in the reference)."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from trainfit.engine import evaluate, optimizer_step
from trainfit.levers.precision import make_precision


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _micro_batches(sizes=(3, 1, 4, 2)) -> list[dict]:
    """Unequal micro-batches: a wrong weighting (mean of means) would show."""
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(n, 8, generator=g), "y": torch.randint(0, 3, (n,), generator=g)} for n in sizes]


def _loss(model, mb):
    return F.cross_entropy(model(mb["x"]), mb["y"], reduction="sum"), len(mb["y"])


def _count(mb) -> int:
    return len(mb["y"])


def _reference(model, batches, *, steps: int, clip: float) -> tuple[list[float], list[float | None]]:
    """Plain PyTorch: one big batch per step, mean loss, clip, SGD with momentum."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.cat([b["x"] for b in batches]), torch.cat([b["y"] for b in batches])
    losses, norms = [], []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)) if clip else None)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_accumulated_step_equals_one_big_batch_of_plain_torch(clip):
    model, batches = _model(), _micro_batches()
    ref_model = copy.deepcopy(model)
    ref_losses, ref_norms = _reference(ref_model, batches, steps=3, clip=clip)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precision = make_precision("fp32")
    for i in range(3):
        res = optimizer_step(model=model, optimizer=opt, precision=precision, micro_batches=batches, loss_fn=_loss,
                             count_fn=_count, grad_clip=clip)
        assert res.stepped and res.count == 10 and res.loss_scale == 1.0
        assert res.loss == pytest.approx(ref_losses[i], rel=1e-6)
        assert res.grad_norm == (pytest.approx(ref_norms[i], rel=1e-5) if clip else None)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert p.grad is None or not p.grad.any()  # the step leaves no gradient behind


def test_a_non_finite_loss_skips_the_step_and_leaves_the_weights():
    model, batches = _model(), _micro_batches()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def poisoned(m, mb):
        loss, n = _loss(m, mb)
        return loss * float("nan") if n == 4 else loss, n

    res = optimizer_step(model=model, optimizer=opt, precision=make_precision("fp32"), micro_batches=batches,
                         loss_fn=poisoned, count_fn=_count, grad_clip=0.0)
    assert not res.stepped and res.loss != res.loss  # NaN
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_evaluate_is_token_weighted_without_grad_and_restores_train_mode():
    model, batches = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 3)), _micro_batches()
    model.train()
    loss_sum, count = evaluate(model=model, precision=make_precision("fp32"), batches=batches, loss_fn=_loss)
    model.eval()
    with torch.no_grad():
        ref = sum(F.cross_entropy(model(b["x"]).double(), b["y"], reduction="sum") for b in batches)
    assert count == 10 and loss_sum == pytest.approx(float(ref), rel=1e-6)  # dropout was off
    model.train()
    assert evaluate(model=model, precision=make_precision("fp32"), batches=batches, loss_fn=_loss)[0] == loss_sum
    assert model.training and all(p.grad is None for p in model.parameters())
