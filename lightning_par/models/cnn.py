"""A small convolutional classifier with BatchNorm -- the model that needs SyncBatchNorm under data
parallelism (per-rank batch statistics differ from the global batch's). Architecture only."""

from __future__ import annotations

import torch
from torch import nn

from lightning_par.parallel.contract import ParallelPlan


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.act(self.bn(self.conv(x))))  # (B, C_out, H/2, W/2)


class Classifier(nn.Module):
    def __init__(self, c_in: int, n_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c_in, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))  # global average pool, then (B, n_classes)


class CNN(nn.Module):
    def __init__(self, in_channels: int = 3, channels: tuple[int, ...] = (16, 32), n_classes: int = 10) -> None:
        super().__init__()
        chans = [in_channels, *channels]
        self.features = nn.ModuleList(ConvBlock(a, b) for a, b in zip(chans[:-1], chans[1:]))
        self.classifier = Classifier(chans[-1], n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, n_classes)
        for block in self.features:
            x = block(x)
        return self.classifier(x)

    def parallel_plan(self) -> ParallelPlan:
        blocks = tuple(f"features.{i}" for i in range(len(self.features)))
        return ParallelPlan(layers=(*blocks, "classifier"), blocks=blocks)
