"""The optimizer factory (lightning_par/core/optim.py): multi-tensor flags, schedules, LR scaling, 8-bit AdamW.

End-to-end: ``scheduler=warmup_cosine`` logs a warm-up then a decaying LR (one quick run); adamw8bit
trains under single, ddp, zero1, zero2, zero3 and fsdp at 2 ranks (one Hydra multirun), and each
rank's optimizer-state bytes, as the memory callback counts them, are within 5% of
the estimator's ``costs.states.optimizer_state_bytes`` for the rank's share of the parameters.
"""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
from torch import nn

from lightning_par import ConfigError
from lightning_par.costs.states import optimizer_state_bytes  # the estimator's count
from lightning_par.core.optim import OptimizerConfig, ScheduleConfig, build_optimizer, build_scheduler, lr_factor, scaled_lr
from tests.dist import run_distributed
from tests.helpers import QUICK, run_cli

# the 8-bit runs compile torchao's update for every tensor shape (each strategy's shards are new shapes)
pytestmark = pytest.mark.timeout(900)


def test_cpu_optimizers_take_the_foreach_path():
    params = list(nn.Linear(4, 4).parameters())
    for name in ("adamw", "adam", "sgd"):
        opt = build_optimizer(params, OptimizerConfig(name))
        assert opt.defaults["foreach"] is True and not opt.defaults.get("fused"), (name, opt.defaults)


def test_unknown_optimizer_and_bad_schedule_are_one_line():
    with pytest.raises(ConfigError, match="unknown optimizer 'lion'"):
        OptimizerConfig("lion")
    with pytest.raises(ConfigError, match="needs scheduler.base_batch_size"):
        ScheduleConfig(lr_scaling="linear")
    with pytest.raises(ConfigError, match="must exceed warmup_steps"):
        build_scheduler(build_optimizer(nn.Linear(2, 2).parameters(), OptimizerConfig()),
                        ScheduleConfig("warmup_cosine", warmup_steps=10), total_steps=10)


def test_lr_scaling_rules():
    assert scaled_lr(1e-3, 64, "none", 16) == 1e-3
    assert scaled_lr(1e-3, 64, "linear", 16) == pytest.approx(4e-3)
    assert scaled_lr(1e-3, 64, "sqrt", 16) == pytest.approx(2e-3)


def test_schedule_shapes():
    total = 100
    for name in ("warmup_cosine", "warmup_linear"):
        cfg = ScheduleConfig(name, warmup_steps=10, min_lr_ratio=0.1)
        f = [lr_factor(s, cfg, total) for s in range(total)]
        assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # linear warm-up to the base LR
        assert all(a < b for a, b in zip(f[:9], f[1:10]))
        assert all(a >= b for a, b in zip(f[10:], f[11:])) and f[-1] < 0.15  # decays to ~min_lr_ratio
    mid = lr_factor(55, ScheduleConfig("warmup_cosine", warmup_steps=10, min_lr_ratio=0.0), total)
    assert mid == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(50, ScheduleConfig("constant"), total) == 1.0


def _sharded_inner_flags(rank: int, world: int) -> dict:
    """zero1's and zero2's inner optimizers and an FSDP (DTensor) AdamW keep the factory's foreach flag."""
    from torch.distributed.fsdp import fully_shard

    from lightning_par.parallel.sharding.zero import Zero2Optimizer, make_zero1_optimizer

    torch.manual_seed(0)
    out = {}
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    out["zero1"] = make_zero1_optimizer(build_optimizer(model.parameters(), OptimizerConfig())).optim.defaults["foreach"]
    model2 = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    z2 = Zero2Optimizer(build_optimizer(model2.parameters(), OptimizerConfig()), model2)
    out["zero2"] = z2.inner.defaults["foreach"]
    model3 = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    fully_shard(model3)
    opt = build_optimizer(model3.parameters(), OptimizerConfig())
    model3(torch.randn(4, 8)).sum().backward()
    opt.step()  # the foreach path on DTensor parameters
    out["fsdp"] = opt.defaults["foreach"] and all(type(p).__name__ == "DTensor" for p in model3.parameters())
    return out


@pytest.mark.slow
def test_sharded_optimizers_keep_the_multi_tensor_path():
    for result in run_distributed(_sharded_inner_flags, 2, timeout=120):
        assert result == {"zero1": True, "zero2": True, "fsdp": True}, result


@pytest.mark.slow
def test_warmup_cosine_logs_warmup_then_decay(tmp_path):
    run_cli([*QUICK, "scheduler=warmup_cosine", "scheduler.warmup_steps=4", "scheduler.min_lr_ratio=0.1",
             "trainer.log_every_n_steps=1"], tmp_path, timeout=240)
    with open(tmp_path / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/lr")]
    lr = [float(r["train/lr"]) for r in sorted(rows, key=lambda r: int(r["step"]))]
    base = 3e-3  # gpt_tiny's model.lr
    assert len(lr) == 12, lr
    assert lr[:4] == pytest.approx([base * (i + 1) / 4 for i in range(4)])  # warm-up
    assert lr[4] == pytest.approx(base)  # decay starts from the base LR...
    assert all(a > b for a, b in zip(lr[4:], lr[5:]))  # ...and then falls at every step
    assert base * 0.1 < lr[-1] < base * 0.2


# --- 8-bit AdamW under every data-parallel strategy -------------------------------------------------
STRATEGIES_8BIT = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp")
SHARDED = {"zero1", "zero2", "zero3", "fsdp"}


@pytest.fixture(scope="module")
def adamw8bit_runs(tmp_path_factory):
    """One multirun: adamw8bit, a wider gpt_tiny (n_embd 256: the 8-bit tensors dominate, as in real
    models; torchao keeps tensors under 4096 elements in fp32), 3 steps, 2 ranks."""
    root = tmp_path_factory.mktemp("adamw8bit")
    quick = [o for o in QUICK if not o.startswith("trainer.max_steps=")]
    run_cli(["-m", *quick, "trainer.max_steps=3", "model.optimizer=adamw8bit",
             "+model.n_embd=256", "trainer.devices=2", f"strategy={','.join(STRATEGIES_8BIT)}",
             f"hydra.sweep.dir={root}"], root, timeout=600)
    out = {}
    for i, name in enumerate(STRATEGIES_8BIT):
        with open(root / str(i) / "summary.json") as f:
            out[name] = json.load(f)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES_8BIT)
def test_adamw8bit_state_bytes_match_the_estimate(adamw8bit_runs, strategy):
    s = adamw8bit_runs[strategy]
    ranks = s["memory"]
    assert s["strategy"] == strategy and len(ranks) == (1 if strategy == "single" else 2)
    losses = s["losses"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    per_rank = s["n_params"] / (len(ranks) if strategy in SHARDED else 1)
    expected = optimizer_state_bytes(per_rank, "adamw8bit")
    for r in ranks:
        assert r["optimizer_state"] == pytest.approx(expected, rel=0.05), (strategy, r, expected)
        # and far below fp32 AdamW's 8 bytes per parameter: the quantised storage is what is counted
        assert r["optimizer_state"] < 0.3 * optimizer_state_bytes(per_rank, "adamw")


def test_data_loader_options_follow_the_device():
    from lightning_par.data import SyntheticTokens

    cpu = SyntheticTokens(num_workers=2).loader_options()  # no trainer: CPU
    assert cpu == {"num_workers": 2, "pin_memory": False, "persistent_workers": True, "prefetch_factor": 2}
    assert SyntheticTokens().loader_options() == {"num_workers": 0, "pin_memory": False, "persistent_workers": False}
    explicit = SyntheticTokens(num_workers=1, pin_memory=True, persistent_workers=False, prefetch_factor=4)
    assert explicit.loader_options() == {"num_workers": 1, "pin_memory": True, "persistent_workers": False,
                                         "prefetch_factor": 4}
    with pytest.raises(ConfigError, match="persistent_workers=true needs data.num_workers > 0"):
        SyntheticTokens(persistent_workers=True)
    with pytest.raises(ConfigError, match="prefetch_factor=4 needs num_workers > 0"):
        SyntheticTokens(prefetch_factor=4)


@pytest.mark.parametrize("name", ["constant", "warmup_cosine", "warmup_linear"])
def test_scheduler_yaml_composes_and_builds(name):
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_par.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"scheduler={name}"])
    from lightning_par.core.optim import schedule_config

    schedule = schedule_config(cfg.scheduler)
    assert schedule.name == name
    opt = build_optimizer(nn.Linear(2, 2).parameters(), OptimizerConfig())
    sched = build_scheduler(opt, schedule, total_steps=100)
    assert (sched is None) == (name == "constant")
