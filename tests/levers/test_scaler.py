"""The loss scaler against torch.amp.GradScaler on a scripted overflow sequence."""

import copy

import pytest
import torch
from torch import nn

from trainfit.engine import optimizer_step
from trainfit.levers.precision import make_precision
from trainfit.levers.scaler import DynamicLossScaler, ScalerConfig, ScalerOrderError

# clean (0) and overflowing (1) steps; growth_interval=3 exercises growth and back-off.
SCRIPT = [0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]


X = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


def _loss(model, overflow):
    loss = model(X).pow(2).sum() * 1e-3
    return loss * float("inf") if overflow else loss


def test_matches_gradscaler_trajectory_and_skips():
    torch.manual_seed(0)
    ref_model = nn.Linear(4, 3)
    our_model = copy.deepcopy(ref_model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    our_opt = torch.optim.SGD(our_model.parameters(), lr=0.1)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    ours = DynamicLossScaler(ScalerConfig(growth_interval=3))
    for overflow in SCRIPT:
        ref_opt.zero_grad()
        our_opt.zero_grad()
        ref.scale(_loss(ref_model, overflow)).backward()
        ours.scale_loss(_loss(our_model, overflow)).backward()
        before = ref.get_scale()
        ref.step(ref_opt)
        ref.update()
        ref_skipped = ref.get_scale() < before
        finite = ours.unscale_([p.grad for p in our_model.parameters()])
        if finite:
            our_opt.step()
        ours.update()
        assert ours.scale == ref.get_scale()
        assert (not finite) == ref_skipped == bool(overflow)
        for a, b in zip(our_model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b)


def test_default_config_matches_issue():
    cfg = ScalerConfig()
    assert (cfg.init_scale, cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval) == (2.0**16, 2.0, 0.5, 2000)


def test_out_of_order_calls_raise():
    s = DynamicLossScaler()
    with pytest.raises(ScalerOrderError):
        s.update()
    s.unscale_([torch.ones(2)])
    with pytest.raises(ScalerOrderError):
        s.unscale_([torch.ones(2)])
    with pytest.raises(ScalerOrderError):
        s.scale_loss(torch.ones(()))
    s.update()
    assert s.scale == 2.0**16


def test_scaler_state_round_trip():
    s = DynamicLossScaler(ScalerConfig(growth_interval=3))
    for found in (False, False, True, False):
        s.unscale_([torch.tensor([float("inf") if found else 1.0])])
        s.update()
    t = DynamicLossScaler(ScalerConfig(growth_interval=3))
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.state.growth_tracker) == (s.scale, s.state.growth_tracker) == (2.0**15, 1)


class _InfAt(nn.Module):
    """Linear whose output becomes inf on demand (to overflow the gradients)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.boom = False

    def forward(self, x):
        y = self.lin(x)
        return y * float("inf") if self.boom else y


@pytest.mark.parametrize("precision", ["fp16-mixed", "fp16-true"])
def test_skipped_step_leaves_every_bit_unchanged(precision):
    torch.manual_seed(0)
    model = _InfAt()
    prec = make_precision(precision, scaler=ScalerConfig(init_scale=2.0**8))  # no overflow at the start
    prec.prepare(model)
    opt = torch.optim.AdamW(prec.optimizer_params(model), lr=1e-2)
    loss_fn = lambda m, x: (m(x).float().pow(2).sum(), x.shape[0])
    mbs = [torch.randn(4, 8).to(prec.param_dtype), torch.randn(2, 8).to(prec.param_dtype)]
    kw = dict(model=model, optimizer=opt, precision=prec, micro_batches=mbs, loss_fn=loss_fn, count_fn=lambda x: x.shape[0])
    assert optimizer_step(**kw).stepped  # creates optimizer state
    params = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for p in prec.optimizer_params(model)]
    state = copy.deepcopy(opt.state_dict())
    scale = prec.loss_scale
    model.boom = True
    res = optimizer_step(**kw)
    assert not res.stepped and prec.loss_scale == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, prec.optimizer_params(model)))
    after = opt.state_dict()
    for k, v in state["state"].items():
        for name, t in v.items():
            assert torch.equal(t, after["state"][k][name]), name
    assert all(p.grad is None for p in model.parameters())  # no gradient left over


def test_scaling_happens_once_per_optimizer_step():
    """With K micro-batches the scale is read once and updated once per optimizer step."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    prec = make_precision("fp16-mixed")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    updates = []
    orig = prec.scaler.update
    prec.scaler.update = lambda: (updates.append(1), orig())[1]
    mbs = [torch.randn(2, 8) for _ in range(4)]
    optimizer_step(model=model, optimizer=opt, precision=prec, micro_batches=mbs,
                   loss_fn=lambda m, x: (m(x).float().sum(), 2), count_fn=lambda x: 2)
    assert updates == [1]
