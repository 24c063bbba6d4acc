"""The memory callback's per-rank figures follow the estimator's ZeRO formulas (lightning_par.costs.estimate).

Measured: bytes of the tensors each rank holds just before an optimizer step (MemoryMonitor), from
the shared e2e runs of ``tests/sweeps.py`` (gpt_tiny, fp32 AdamW, 2 and 4 ranks). Expected:
``estimate(Ψ, devices=N, strategy=..., precision="32-true", optimizer="adamw")``. Tolerances,
all one-sided (measured >= expected) and explained by what the formula leaves out:

- optimizer state: + 4 bytes per parameter tensor held (AdamW's scalar ``step``; zero2 keeps one
  per param group, its state being one flat shard);
- zero2 parameters: + up to 4 (N - 1) bytes (the flat buffer is padded to a multiple of N);
- zero3/fsdp: + 1% (FSDP pads each parameter's dim 0 to a multiple of N, the formula pads Ψ once;
  exact for gpt_tiny, whose dims all divide by 4);
- zero1: ZeroRedundancyOptimizer gives each rank *whole* parameters (greedy by size), so a rank's
  optimizer state differs from kΨ/N by at most k x the largest parameter; the sum over ranks is kΨ.
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.costs.estimate import estimate
from lightning_par.models import GPTModule
from tests.sweeps import four_ranks, two_ranks_accumulating

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STAGES = ("ddp", "zero1", "zero2", "zero3")


@pytest.fixture(scope="module")
def model_facts() -> dict[str, int]:
    model = GPTModule(preset="gpt_tiny")
    with torch.device("meta"):  # shapes are all this needs; the architecture is built in configure_model
        model.configure_model()
    params = list(model.parameters())
    return {"n": sum(p.numel() for p in params), "tensors": len(params), "largest": max(p.numel() for p in params)}


def runs(world: int) -> dict[str, dict]:
    return four_ranks() if world == 4 else two_ranks_accumulating()


def _within(measured: int, expected: int, slack: float, what: str) -> None:
    assert expected <= measured <= expected + slack, f"{what}: measured {measured}, expected {expected} (+{slack:.0f})"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", [*STAGES, "fsdp"])
def test_per_rank_model_states_follow_the_formulas(strategy, world, model_facts):
    s = runs(world)[strategy]
    n, tensors, largest = model_facts["n"], model_facts["tensors"], model_facts["largest"]
    assert s["n_params"] == n and len(s["memory"]) == world
    exp = estimate(n, devices=world, strategy=strategy, precision="32-true", optimizer="adamw")
    steps = 4 * tensors
    for m in s["memory"]:
        what = f"{strategy} x{world} rank {m['rank']}"
        if strategy == "zero1":
            _within(m["params"], exp.params, 0, what + " params")
            _within(m["grads"], exp.grads, 0, what + " grads")
            assert abs(m["optimizer_state"] - exp.optimizer_state) <= 8 * largest + steps, what
        elif strategy == "zero2":
            _within(m["params"], exp.params, 4 * (world - 1), what + " params")
            _within(m["grads"], exp.grads, 0, what + " grads")
            _within(m["optimizer_state"], exp.optimizer_state, 4, what + " optimizer state")
        elif strategy in ("zero3", "fsdp"):
            _within(m["params"], exp.params, 0.01 * exp.params, what + " params")
            _within(m["grads"], exp.grads, 0.01 * exp.grads, what + " grads")
            _within(m["optimizer_state"], exp.optimizer_state, 0.01 * exp.optimizer_state + steps, what + " optim")
        else:
            _within(m["params"], exp.params, 0, what + " params")
            _within(m["grads"], exp.grads, 0, what + " grads")
            _within(m["optimizer_state"], exp.optimizer_state, steps, what + " optimizer state")
        assert m["offloaded"] == 0
    if strategy == "zero1":  # whole parameters per rank, but together exactly one copy of the state
        total = sum(m["optimizer_state"] for m in s["memory"])
        _within(total, 8 * n, steps, "zero1 optimizer state summed over ranks")


@pytest.mark.parametrize("world", [2, 4])
def test_model_state_bytes_fall_stage_by_stage(world):
    per_rank = {name: max(m["params"] + m["grads"] + m["optimizer_state"] for m in runs(world)[name]["memory"])
                for name in (*STAGES, "fsdp")}
    totals = [per_rank[name] for name in STAGES]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4, per_rank
    assert per_rank["fsdp"] == per_rank["zero3"]
    # the sharded categories shrink by N: zero3 holds 1/N of ddp's 16 bytes per parameter
    assert per_rank["zero3"] * world == pytest.approx(per_rank["ddp"], rel=0.01)


def test_hsdp_shards_within_its_group(model_facts):
    """hsdp on 4 ranks = 2 replicas x 2 shards: each rank holds what fsdp on 2 ranks holds."""
    n = model_facts["n"]
    exp = estimate(n, devices=2, strategy="fsdp", precision="32-true")
    memory = four_ranks()["hsdp"]["memory"]
    assert len(memory) == 4  # one entry per rank: the loop below checks every one
    for m in memory:
        _within(m["params"], exp.params, 0.01 * exp.params, "hsdp params")
        _within(m["optimizer_state"], exp.optimizer_state, 0.01 * exp.optimizer_state + 4 * model_facts["tensors"],
                "hsdp optimizer state")


def test_zero3_offload_matches_the_offload_row(model_facts):
    n = model_facts["n"]
    exp = estimate(n, devices=2, strategy="zero3_offload", precision="32-true")
    assert (exp.params, exp.grads, exp.optimizer_state) == (0, 0, 0)  # nothing on the device
    memory = two_ranks_accumulating()["zero3_offload"]["memory"]
    assert len(memory) == 2  # one entry per rank: the loop below checks every one
    for m in memory:
        _within(m["offloaded"], exp.offloaded, 0.01 * exp.offloaded + 4 * model_facts["tensors"], "offloaded")


def test_cuda_peak_is_read_before_teardown(monkeypatch):
    """The allocator's peak is taken in on_train_end, while the module is still on its GPU: Lightning's
    teardown (before on_fit_end) moves single/DDP modules back to the CPU. Simulated: no GPU here."""
    from types import SimpleNamespace

    from lightning_par.callbacks.memory import MemoryMonitor

    peaks = iter([123_456, 999_999])  # a later read would see the second value
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(peaks))
    module = torch.nn.Linear(4, 4)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), optimizers=[],
                              global_rank=0, global_step=0)
    cb = MemoryMonitor()
    cb.on_train_end(trainer, module)
    trainer.strategy.root_device = torch.device("cpu")  # what teardown leaves behind
    cb.on_fit_end(trainer, module)
    (mine,) = cb.summary()["memory"]
    assert mine["peak_allocated"] == 123_456 and mine["params"] == 4 * 20
