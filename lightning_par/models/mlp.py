"""A plain multi-layer perceptron classifier: ``layers.0 .. layers.{depth-1}`` (Linear + GELU)
followed by ``out``. Architecture only; its plan declares the hidden layers as blocks and a
column/row tensor-parallel split of consecutive pairs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_par.parallel.contract import ParallelPlan


class Dense(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class MLPNet(nn.Module):
    def __init__(self, in_dim: int = 32, hidden: int = 256, depth: int = 4, n_classes: int = 10) -> None:
        super().__init__()
        dims = [in_dim] + [hidden] * depth
        self.layers = nn.ModuleList(Dense(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.out = nn.Linear(hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in_dim) -> (B, n_classes)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)

    def parallel_plan(self) -> ParallelPlan:
        n = len(self.layers)
        blocks = tuple(f"layers.{i}" for i in range(n))
        # Megatron pairing: odd hidden layers split by columns, the next by rows (one all-reduce per pair)
        tp = {f"layers.{i}.fc": ("colwise" if i % 2 == 1 else "rowwise") for i in range(1, n - (n - 1) % 2)}
        return ParallelPlan(layers=(*blocks, "out"), blocks=blocks, tp_plan=tp,
                            tp_divisible={"hidden": self.layers[0].fc.out_features})
