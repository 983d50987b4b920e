"""Precision policies: master weights, autocast placement, dtypes."""

import torch
from torch import nn

from trainfit.engine import optimizer_step
from trainfit.levers.precision import make_precision
from trainfit.vocabulary import PRECISIONS


def test_master_weights_keep_updates_smaller_than_fp16_spacing():
    # fp16 spacing just below 1.0 is 2**-11 ~ 4.9e-4: an update of 1e-4 rounds away.
    lin = nn.Linear(1, 1, bias=False)
    nn.init.constant_(lin.weight, 1.0)
    prec = make_precision("fp16-true")
    prec.prepare(lin)
    opt = torch.optim.SGD(prec.optimizer_params(lin), lr=1.0)
    direct = torch.ones(1, dtype=torch.float16)
    stepped = 0
    while stepped < 10:
        # Gradient of loss = w * 1e-4 (scaled by the loss scaler internally). The first step
        # overflows (65536 exceeds fp16's max 65504) and is skipped, as GradScaler would.
        stepped += optimizer_step(model=lin, optimizer=opt, precision=prec, micro_batches=[torch.ones(1, 1, dtype=torch.float16)],
                       loss_fn=lambda m, x: ((m(x) * 1e-4).float().sum(), 1), count_fn=lambda x: 1).stepped
        direct -= torch.tensor(1e-4, dtype=torch.float16)
    master = prec.optimizer_params(lin)[0]
    assert abs(master.item() - (1 - 10 * 1.0001659e-4)) < 1e-6  # 1e-4 rounded to fp16  # every tiny update landed in fp32
    assert lin.weight.dtype == torch.float16 and lin.weight.item() < 1.0  # and reached the fp16 weight
    assert lin.weight.item() == torch.tensor(1 - 1e-3).half().item()
    assert direct.item() == 1.0  # applied directly to fp16, they all vanished


def test_autocast_wraps_forward_only_and_weights_stay_fp32():
    seen = {}
    lin = nn.Linear(4, 4)
    lin.register_forward_hook(lambda m, i, o: seen.update(out=o.dtype))
    prec = make_precision("bf16-mixed")
    prec.prepare(lin)
    opt = torch.optim.SGD(prec.optimizer_params(lin), lr=0.1)
    grad_dtypes = []
    lin.weight.register_hook(lambda g: grad_dtypes.append((g.dtype, torch.is_autocast_enabled("cpu"))))
    optimizer_step(model=lin, optimizer=opt, precision=prec, micro_batches=[torch.randn(2, 4)],
                   loss_fn=lambda m, x: (m(x).float().sum(), 2), count_fn=lambda x: 2)
    assert seen["out"] == torch.bfloat16
    assert lin.weight.dtype == torch.float32
    assert grad_dtypes == [(torch.float32, False)]  # backward runs outside autocast


def test_true_precisions_store_half_weights_and_fp32_masters():
    for name, dtype in (("bf16-true", torch.bfloat16), ("fp16-true", torch.float16)):
        lin = nn.Linear(4, 4)
        w0 = lin.weight.detach().clone()
        prec = make_precision(name)
        prec.prepare(lin)
        assert lin.weight.dtype == dtype
        masters = prec.optimizer_params(lin)
        assert all(m.dtype == torch.float32 for m in masters)
        assert torch.equal(masters[0], w0)  # the master is the exact fp32 original


def test_scaling_only_where_needed():
    enabled = {n: make_precision(n).scales_loss for n in PRECISIONS}
    assert enabled == {"fp32": False, "bf16-mixed": False, "fp16-mixed": True, "bf16-true": False, "fp16-true": True}
