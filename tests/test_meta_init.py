"""Meta-device initialisation sets every tensor: what no init function covers gets the value the
constructor gave it (``parallel/init/init_trace.py``), and anything still unset is an error naming it.

Freshly allocated memory is made NaN (a sentinel) before materialisation, so a tensor that nothing
fills shows up as NaN instead of as whatever the allocator happened to return (often zeros, which
would hide the defect).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_par.parallel.discovery import init_fn_of, resolve_plan
from lightning_par.parallel.init.init_trace import InitTrace
from lightning_par.parallel.parallelize import Techniques, parallelize


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gain = nn.Parameter(torch.ones(d))  # layer scale: no reset_parameters covers it
        nn.init.normal_(self.fc.weight, std=0.002)  # the constructor overrides Linear's own init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain * self.fc(x)


class ViTLike(nn.Module):
    """A cls token and position embedding made directly, a constant buffer, an integer buffer."""

    def __init__(self, d: int = 64, n: int = 65) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos_embed = nn.Parameter(torch.zeros(1, n, d))
        nn.init.trunc_normal_(self.pos_embed, std=0.02, a=-0.04, b=0.04)  # cut at 2 std
        self.register_buffer("scale", torch.full((d,), 0.5))
        self.register_buffer("ids", torch.arange(n).view(1, n))
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed[:, self.ids[0]]
        for b in self.blocks:
            x = b(x)
        return (x * self.scale).mean()


@pytest.fixture
def nan_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``to_empty`` hands out NaN (floats) / -1 (integers) instead of the allocator's leftovers."""
    original = nn.Module.to_empty

    def poisoned(self: nn.Module, *, device, recurse: bool = True) -> nn.Module:  # noqa: ANN001
        out = original(self, device=device, recurse=recurse)
        with torch.no_grad():
            for t in [*out.parameters(), *out.buffers()]:
                t.fill_(float("nan") if t.is_floating_point() else -1)
        return out

    monkeypatch.setattr(nn.Module, "to_empty", poisoned)


def build(trace: InitTrace | None, seed: int = 0) -> nn.Module:
    with torch.device("meta"):
        if trace is None:
            model = ViTLike()
        else:
            with trace.recording():
                model = ViTLike()
    parallelize(model, Techniques(device=torch.device("cpu"), plan=resolve_plan(model), seed=seed,
                                  init_fn=init_fn_of(model), init_trace=trace))
    return model


def test_every_tensor_gets_its_constructor_value(nan_memory: None) -> None:
    model = build(InitTrace())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert not t.is_meta and not (t.is_floating_point() and t.isnan().any()), name
    assert torch.equal(model.scale, torch.full((64,), 0.5))
    assert torch.equal(model.ids, torch.arange(65).view(1, 65))
    for b in model.blocks:
        assert torch.equal(b.gain, torch.ones(64))
        assert 0.0017 < b.fc.weight.std().item() < 0.0023  # the constructor's std, not Linear's (0.07)
        assert b.fc.bias.abs().max() <= 64 ** -0.5 and b.fc.bias.std() > 0.01  # Linear's own bias init
    assert 0.0165 < model.pos_embed.std().item() < 0.019 and model.pos_embed.abs().max() <= 0.04  # 0.88 x 0.02
    assert 0.012 < model.cls_token.std().item() < 0.028
    assert torch.isfinite(model(torch.randn(2, 64, 64)))
    # a function of the seed alone: the same values again, other values with another seed
    again, other = build(InitTrace()), build(InitTrace(), seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert not torch.equal(model.cls_token, other.cls_token)


def test_unset_tensor_without_a_record_is_an_error(nan_memory: None) -> None:
    # built on the meta device by hand, nothing recorded: the cls token has no init function
    with pytest.raises(RuntimeError, match=r"materialize: blocks.0.gain of shape \(64,\) is set by no init function"):
        build(None)
