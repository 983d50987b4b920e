"""Accumulation equivalence against plain PyTorch on one big padded batch."""

import pytest
import torch
from torch.nn import functional as F

from trainfit.engine import optimizer_step
from trainfit.levers.accumulation import AccumulationWindow, loss_weight, warn_if_batchnorm
from trainfit.levers.precision import make_precision
from trainfit.tasks.make import make_task
from trainfit.tasks.synthetic import IGNORE_INDEX

TINY = "n_layer=2,d_model=32,n_head=2"


class RecordingSGD(torch.optim.SGD):
    """Records the gradients the optimizer sees, then does nothing."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])


def _reference_grads(model, samples):
    """Plain PyTorch: one big right-padded batch, mean over non-ignored tokens."""
    task = make_task("gpt-tiny", model_config=TINY, seq_len=32)
    big = task.collate(samples)
    model.zero_grad(set_to_none=True)
    logits = model(big["input_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1), big["labels"].flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _max_rel_err(a, b):
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))


@pytest.mark.parametrize("sizes", [[4, 4, 4, 4], [4, 4, 4, 2], [1, 7, 3, 5]], ids=["even", "partial-last", "ragged"])
def test_window_gradient_equals_big_batch(sizes):
    task = make_task("gpt-tiny", model_config=TINY, seq_len=32)
    model = task.build_model()
    ds = task.dataset()
    samples = [ds[i] for i in range(sum(sizes))]
    counts = [int(s["labels"].numel()) for s in samples]
    assert len(set(counts)) > 3, "the data must have varying lengths for this test to mean anything"
    mbs, i = [], 0
    for n in sizes:
        mbs.append(task.collate(samples[i : i + n]))
        i += n
    ref = _reference_grads(model, samples)
    opt = RecordingSGD(model.parameters())
    res = optimizer_step(model=model, optimizer=opt, precision=make_precision("fp32"), micro_batches=mbs,
                         loss_fn=task.loss, count_fn=task.count)
    assert res.count == sum(counts)
    assert _max_rel_err(opt.seen[0], ref) <= 1e-5


def test_mean_of_means_would_fail_on_the_same_data():
    task = make_task("gpt-tiny", model_config=TINY, seq_len=32)
    model = task.build_model()
    ds = task.dataset()
    samples = [ds[i] for i in range(14)]
    mbs = [task.collate(samples[a:b]) for a, b in ((0, 4), (4, 8), (8, 12), (12, 14))]
    ref = _reference_grads(model, samples)
    model.zero_grad(set_to_none=True)
    for mb in mbs:  # the common mistake: mean per micro-batch, divided by K
        loss_sum, n = task.loss(model, mb)
        (loss_sum / n / len(mbs)).backward()
    naive = [p.grad.detach().clone() for p in model.parameters()]
    assert _max_rel_err(naive, ref) > 1e-2


def test_loss_weight_and_window_state_machine():
    assert loss_weight(200, 1) == pytest.approx(1 / 200)
    assert loss_weight(200, 4) == pytest.approx(4 / 200)  # DDP averages over 4 ranks
    w = AccumulationWindow([1, 2, 3], count=lambda mb: mb)
    assert w.global_count == 6
    assert [last for _, last in w] == [False, False, True]
    with pytest.raises(RuntimeError, match="already done"):
        list(w)


def test_window_count_is_all_reduced():
    calls = []

    def fake_all_reduce(t):
        calls.append(t.item())
        t.mul_(2)  # as if a second rank had the same count

    w = AccumulationWindow([5, 5], count=lambda mb: mb, all_reduce_sum=fake_all_reduce, world_size=2)
    assert calls == [10.0] and w.global_count == 20 and w.weight == pytest.approx(2 / 20)


def test_batchnorm_warning_names_the_layers():
    model = make_task("cnn").build_model()
    with pytest.warns(UserWarning, match=r"blocks\.0\.bn, blocks\.1\.bn"):
        names = warn_if_batchnorm(model, accumulation=4)
    assert names == ["blocks.0.bn", "blocks.1.bn"]
