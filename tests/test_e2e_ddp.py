"""End-to-end: run.py under single and ddp; DDP reproduces single-device losses at 2 and 4 ranks.

The single-device reference and the 4-rank ddp run are the shared sweeps' (``tests/sweeps.py``: the same
QUICK config); the 2-rank ddp run is the two-job multirun's, which this module runs once. That multirun and
this module's other runs run one after another in one process (``runs``, ``tests/serial.py``), each as the
command runs it."""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest

from lightning_par.callbacks import CONTRACT_KEYS
from tests import launch, serial
from tests.helpers import QUICK, ROOT, assert_losses_match
from tests.sweeps import four_ranks, single_refs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # the first test of ``runs`` runs them all


@pytest.fixture(scope="module")
def single_ref():
    return single_refs()[0]


CNN = ["experiment=cnn", "trainer.max_steps=10", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
       "data.global_batch_size=16", "data.n_samples=512"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, serial.Run]:
    """This module's runs, one after another in one process (``tests/serial.py``): the two-job multirun
    (``run.py -m strategy=single,ddp trainer.devices=2``, its sweep directory ``multirun/sweep``), then the
    single runs, each in a run directory of its own."""
    root = tmp_path_factory.mktemp("runs")
    return serial.app_runs({
        "multirun": ["-m", *QUICK, "strategy=single,ddp", "trainer.devices=2", f"hydra.sweep.dir={root / 'multirun' / 'sweep'}"],
        "accumulating": [*QUICK, "strategy=ddp", "trainer.devices=2", "trainer.accumulate_grad_batches=2"],
        "cnn-single": CNN,
        "cnn-sync": [*CNN, "strategy=ddp", "strategy.sync_batchnorm=true", "trainer.devices=2"],
        "cnn-plain": [*CNN, "strategy=ddp", "trainer.devices=2"],
        "bf16": [*QUICK, "strategy=ddp", "trainer.devices=2", "trainer.precision=bf16-mixed"],
    }, root)


@pytest.fixture(scope="module")
def two_job_sweep(runs):
    """``run.py -m strategy=single,ddp trainer.devices=2``: a multirun of two jobs (the 2-rank ddp run)."""
    runs["multirun"].job.check()
    return runs["multirun"].dir / "sweep"


def test_single_summary_contract(single_ref):
    missing = [k for k in CONTRACT_KEYS if k not in single_ref]
    assert not missing, missing
    assert single_ref["world_size"] == 1 and single_ref["steps"] == 12 == len(single_ref["losses"])
    assert single_ref["final_loss"] == single_ref["losses"][-1]
    assert single_ref["losses"][-1] < single_ref["losses"][0] - 0.5  # it learns
    (mem,) = single_ref["memory"]
    n = single_ref["n_params"]
    assert mem["params"] == mem["grads"] == 4 * n  # fp32 params and grads, one full copy
    assert 8 * n <= mem["optimizer_state"] <= 8 * n + 4 * 64  # AdamW m and v (+ scalar step counters)
    assert mem["peak_rss"] > 0 and mem["peak_allocated"] is None
    assert single_ref["step_time_s"] > 0 and single_ref["tokens_per_s"] > 0


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_matches_single(single_ref, two_job_sweep, world):
    # 4 ranks: the shared sweep's ddp job (it also saves checkpoints, which leaves the losses alone)
    s = json.loads((two_job_sweep / "1" / "summary.json").read_text()) if world == 2 else four_ranks()["ddp"]
    assert s["world_size"] == world and s["mesh"] == {"dp_replicate": world}
    assert len(s["memory"]) == world and [m["rank"] for m in s["memory"]] == list(range(world))
    assert_losses_match(s, single_ref)


def test_gradient_accumulation_matches(single_ref, runs):
    # same global batch (8) as 2 ranks x 2 micro-batches of 2: same per-step losses
    s = runs["accumulating"].summary()
    assert_losses_match(s, single_ref)


def test_syncbatchnorm_ddp_matches_single_batchnorm(runs):
    ref = runs["cnn-single"].summary()
    synced = runs["cnn-sync"].summary()
    assert_losses_match(synced, ref, rtol=1e-4)
    # without SyncBatchNorm, per-rank statistics differ from the global batch's: losses drift apart
    plain = runs["cnn-plain"].summary()
    assert not np.allclose(plain["losses"], ref["losses"], rtol=1e-4, atol=1e-6)


def test_bf16_mixed_ddp_trains(runs):
    s = runs["bf16"].summary()
    assert s["precision"] == "bf16-mixed"
    assert np.all(np.isfinite(s["losses"])) and s["losses"][-1] < s["losses"][0] - 0.5


def test_multirun_two_jobs_two_summaries(two_job_sweep, single_ref):
    sweep = two_job_sweep
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml"]
    summaries = sorted(sweep.glob("**/summary.json"))
    assert [p.parent.name for p in summaries] == ["0", "1"]
    single, ddp = (json.loads(p.read_text()) for p in summaries)
    assert (single["strategy"], single["world_size"]) == ("single", 1)
    assert (ddp["strategy"], ddp["world_size"]) == ("ddp", 2)
    assert_losses_match(ddp, single)
    assert_losses_match(single, single_ref)  # the multirun's job is the single run of the same config
    # no stray run directories from child processes (they would land in outputs/ or a nested sweep)
    for job in ("0", "1"):
        assert not (sweep / job / "multirun").exists() and not (sweep / job / "outputs").exists()


USER_SCRIPT = '''
import sys
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from hydra.utils import instantiate
from omegaconf import OmegaConf

class Regressor(L.LightningModule):  # written by "a user", not by lightning_par
    def __init__(self):
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

if __name__ == "__main__":
    L.seed_everything(0)
    x = torch.randn(256, 8); y = x.sum(1, keepdim=True)
    strategy = instantiate(OmegaConf.load(sys.argv[1]))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Regressor()
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    # one write per line: both ranks share this stdout, and print() may write the text and its newline apart
    sys.stdout.write(f"RANK{trainer.global_rank} world={trainer.world_size} steps={trainer.global_step} "
                     f"loss={float(trainer.callback_metrics['loss']):.4f} type={type(trainer.strategy).__name__}\\n")
    sys.stdout.flush()
'''


def test_user_lightning_module_with_strategy_yaml(tmp_path):
    script = tmp_path / "user_train.py"
    script.write_text(USER_SCRIPT)
    proc = launch.run([sys.executable, str(script), str(ROOT / "lightning_par/conf/strategy/ddp.yaml")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # no rank may abort at interpreter exit (gloo's workers outliving the interpreter, base.py)
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    ranks = re.findall(r"RANK(\d) world=(\d+) steps=(\d+) loss=([\d.]+) type=(\w+)", proc.stdout)
    assert sorted(r[0] for r in ranks) == ["0", "1"], proc.stdout
    for _, world, steps, loss, cls in ranks:
        assert (world, steps, cls) == ("2", "16", "DDPStrategy")
        assert float(loss) < 1.0  # y = sum(x) has variance 8 at the start
