"""A small CNN with BatchNorm: the model for which accumulation is *not* exact.

BatchNorm normalises with the statistics of the micro-batch it sees, so K micro-batches
of size b do not compute the same function as one batch of K*b. trainfit warns about it.
"""

from __future__ import annotations

import torch
from torch import nn


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class SmallCNN(nn.Module):
    def __init__(self, *, channels: int = 32, n_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ConvBlock(in_channels, channels), ConvBlock(channels, 2 * channels)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(2 * channels, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 0:
                x = nn.functional.max_pool2d(x, 2)
        return self.head(self.pool(x).flatten(1))
