"""A user model for tests, through the module:callable protocol (trainfit.tasks.user)."""

import torch
from torch import nn
from torch.nn import functional as F

D_IN, D_HID, D_OUT = 16, 32, 8


def make(seed=0):
    def build():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_OUT))

    def batch(n):
        g = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(n, D_IN, generator=g), "y": torch.randint(0, D_OUT, (n,), generator=g)}

    def loss(model, b):
        x = b["x"].to(next(model.parameters()).dtype)
        return F.cross_entropy(model(x).float(), b["y"], reduction="sum"), len(b["y"])

    return {"model": build, "batch": batch, "loss": loss}


def not_a_task():
    return 42


def broken():
    raise RuntimeError("the user's factory failed")


def bad_loss():
    spec = make()
    spec["loss"] = lambda m, b: m(b["x"]).sum()  # a tensor, not (loss_sum, count)
    return spec
