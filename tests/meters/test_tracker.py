"""The storage tracker on hand-made tensors: views and shared storages count once, frees are seen."""

import pytest
import torch

from trainfit.meters.tracker import MemoryTracker


def test_views_share_one_storage_and_frees_are_noticed():
    w = torch.randn(256)  # 1024 B, created before tracking: counted when first used
    with MemoryTracker() as tr:
        a = w * 2  # +1024
        v = a[:128]  # a view: no new storage
        b = v + 1  # +512
        assert tr.live_bytes == 1024 + 1024 + 512
        del a  # the view keeps a's storage alive
        c = b + 1  # +512
        assert tr.live_bytes == 1024 + 1024 + 512 + 512
        del v  # now a's storage is gone
        d = c * 3  # +512, -1024
        assert tr.live_bytes == 1024 + 512 + 512 + 512
    assert tr.peak_bytes == 1024 + 1024 + 512 + 512
    assert d.numel() == 128


def test_saved_for_backward_is_activations_and_params_stay_params():
    lin = torch.nn.Linear(8, 4, bias=False)  # 128 B weight
    x = torch.randn(3, 8)  # 96 B, saved by the matmul
    tr = MemoryTracker()
    tr.register_run(lin)
    with tr:
        y = torch.tanh(lin(x))  # tanh saves its output: 48 B
        assert tr.totals["params"] == 128
        assert tr.totals["activations"] == 96 + 48
        y.sum().backward()
    assert lin.weight.grad is not None and tr.part_max["grads"] == 128


def test_cap_raises_out_of_memory_with_the_numbers():
    with pytest.raises(torch.OutOfMemoryError, match="exceed memory_cap=4,000"):
        with MemoryTracker(cap_bytes=4000, exact=False, classify=False):
            a = torch.zeros(500)  # 2000 B
            b = torch.zeros(500)  # 4000 B: at the cap, fine
            c = torch.zeros(10)  # 4040 B: over
            del a, b, c


def test_storage_resized_outside_dispatch_is_seen_when_tracking_resizes():
    # FSDP2 frees gathered parameters with untyped_storage().resize_(0): no aten op announces it.
    t = torch.zeros(256)  # 1024 B
    tr = MemoryTracker()
    tr.track_resizes = True
    with tr:
        u = t + 1  # +1024
        u.untyped_storage().resize_(0)
        v = t * 2  # +1024; the sweep after this op re-reads u's size: 0
        assert tr.live_bytes == 1024 + 1024
    assert v.numel() == 256
