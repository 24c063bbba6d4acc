"""Issue 19 (c) and (d), from a user's own script (plain ``lightning.Trainer``, strategies by registry name):

(c) ``Trainer(sync_batchnorm=True)`` under every data-parallel / sharded strategy and the mesh
    strategies: a BatchNorm ResNet's per-step losses equal the single-device run on the GLOBAL batch
    (what BatchNorm over all data-parallel ranks computes), and differ from unsynchronised DDP (so
    the check can fail: before the fix lp_zero2/zero3/zero3_offload/fsdp equalled unsynchronised DDP).
    The BatchNorm running statistics after training equal the single-device run's too. A pipeline,
    where it cannot be honoured (micro-batches), refuses in one line.
(d) A parameter unused on some steps (a step-dependent branch) and one never used: lp_ddp without
    ``find_unused_parameters`` stops with one line naming that option (not torch's traceback
    recommending Lightning's ``ddp_find_unused_parameters_true``); with it lp_ddp and lp_zero1 train
    and match lp_single, and so do zero3 / zero3_offload / fsdp (FSDP2 leaves such gradients None,
    which need no option); zero2, which cannot skip them, stops in one line.

One script run trains several strategies one after another in the same processes (as
``test_own_model.py``), so the module costs a few process starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests import launch

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import lightning_par.strategies  # registers lp_ddp, lp_zero3, ...
    from lightning_par.parallel.contract import ParallelPlan
    from lightning_par.strategies import DDPStrategy, Zero1Strategy

    class ResBlock(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x):
            return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))

    class ResNet(nn.Module):
        def __init__(self, c=8, n_classes=4):
            super().__init__()
            self.stem, self.bn = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.blocks = nn.ModuleList(ResBlock(c) for _ in range(2))
            self.norm = nn.BatchNorm1d(c)  # 1-d, on the pooled features
            self.fc1, self.fc2 = nn.Linear(c, 32), nn.Linear(32, n_classes)

        def forward(self, x):
            x = torch.relu(self.bn(self.stem(x)))
            for block in self.blocks:
                x = block(x)
            return self.fc2(torch.relu(self.fc1(self.norm(x.mean((2, 3))))))

    class Classifier(L.LightningModule):
        """Built in configure_model: on the meta device under lightning_par's strategies."""
        def __init__(self):
            super().__init__()
            self.net = None

        def configure_model(self):
            if self.net is None:
                self.net = ResNet()

        def parallel_plan(self):  # the head for lp_tensor_parallel / lp_fsdp_tp; the convolutions stay whole
            return ParallelPlan(blocks=("net.blocks.0", "net.blocks.1"),
                                tp_plan={"net.fc1": "colwise", "net.fc2": "rowwise"})

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Branchy(L.LightningModule):
        """``aux`` is used on every third step only (a step-dependent branch); ``never`` is never used."""
        def __init__(self, d=16):
            super().__init__()
            self.d, self.blocks = d, None

        def configure_model(self):
            if self.blocks is None:
                d = self.d
                self.stem = nn.Linear(12, d)
                self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.Tanh())
                                            for _ in range(2))
                self.aux, self.never, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 5)

        def training_step(self, batch, batch_idx):
            x, y = batch
            h = self.stem(x)
            for block in self.blocks:
                h = h + block(h)
            if batch_idx % 3 == 1:
                h = h + torch.tanh(self.aux(h))
            loss = nn.functional.cross_entropy(self.head(h), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Record(L.Callback):
        def __init__(self):
            self.losses, self.running = [], {}

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            # the global-batch mean: data ranks hold equal slices (tp ranks the same batch)
            self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

        def on_train_end(self, trainer, module):
            full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
            self.running = {n: full(b).tolist() for n, b in module.named_buffers() if "running_" in n}

    STRATEGIES = {
        "lp_ddp_nosync": ("lp_ddp", False),
        "lp_ddp_unused": (lambda: DDPStrategy(find_unused_parameters=True), False),
        "lp_zero1_unused": (lambda: Zero1Strategy(find_unused_parameters=True), False),
    }

    def run(name, devices, model_cls, batch):
        strategy, sync = STRATEGIES.get(name, (name, model_cls is Classifier))
        strategy = strategy() if callable(strategy) else strategy
        L.seed_everything(0, verbose=False)
        g = torch.Generator().manual_seed(1)
        if model_cls is Classifier:
            x = torch.randn(256, 3, 8, 8, generator=g) * 2 + 0.5
            y = (x.mean((2, 3)) @ torch.randn(3, 4, generator=g)).argmax(-1)
        else:
            x = torch.randn(256, 12, generator=g)
            y = (x @ torch.randn(12, 5, generator=g)).argmax(-1)
        # under every strategy, lp_single included, Lightning's DistributedSampler shuffles the training set
        # (seed 0, epoch 0) even when the DataLoader does not: batch k of the one-device run is the union
        # of the ranks' batches k -- the global batch
        record = Record()
        trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=STEPS,
                            sync_batchnorm=sync, callbacks=[record], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model_cls(), DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False))
        return {"losses": record.losses, "running": record.running}

    STEPS = 9
    out, devices, model_name, names = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
    model_cls = {"resnet": Classifier, "branchy": Branchy}[model_name]
    result = {}
    for name in names:
        # the global batch of 16 split over the data-parallel ranks (a tensor-parallel group reads one batch;
        # lp_tensor_parallel: tp = the world, lp_fsdp_tp: tp = 2)
        dp = {"lp_single": 1, "lp_tensor_parallel": 1, "lp_fsdp_tp": devices // 2}.get(name, devices)
        result[name] = run(name, devices, model_cls, batch=16 // dp)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(result, f)
''')

SHARDED = ["lp_zero2", "lp_zero3", "lp_zero3_offload", "lp_fsdp"]
TWO_RANKS_BN = ["lp_ddp_nosync", "lp_ddp", "lp_zero1", *SHARDED, "lp_tensor_parallel"]
FOUR_RANKS_BN = ["lp_hsdp", "lp_fsdp_tp"]  # fsdp_tp: tp=2 x dp_shard=2, BatchNorm synced over dp_shard only
#: measured float32 deviation from the single-device run is below 1e-5 (see the report); unsynchronised
#: DDP deviates by > 1e-2 from the first step
RTOL, ATOL = 1e-4, 1e-5


def run_script(tmp_path: Path, devices: int, model: str, strategies: list[str],
               timeout: float = 420) -> subprocess.CompletedProcess:
    script = tmp_path / "train_mine.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"out_{model}_{devices}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = launch.run([sys.executable, str(script), str(out), str(devices), model, ",".join(strategies)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    proc.result = json.loads(out.read_text()) if proc.returncode == 0 else None  # type: ignore[attr-defined]
    return proc


def results(tmp_path: Path, devices: int, model: str, strategies: list[str]) -> dict:
    proc = run_script(tmp_path, devices, model, strategies)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.result  # type: ignore[attr-defined]


def max_dev(got: list[float], ref: list[float]) -> float:
    return float(np.max(np.abs(np.asarray(got) - np.asarray(ref))))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sync_batchnorm_every_strategy_equals_single_device_on_global_batch(tmp_path: Path) -> None:
    ref_run = results(tmp_path, 1, "resnet", ["lp_single"])["lp_single"]  # batch 16 on one device
    ref = ref_run["losses"]
    assert len(ref) == 9 and ref[-1] < ref[0], ref  # it learns
    two = results(tmp_path, 2, "resnet", TWO_RANKS_BN)
    four = results(tmp_path, 4, "resnet", FOUR_RANKS_BN)
    unsynced = two.pop("lp_ddp_nosync")["losses"]
    # the check can fail: per-rank statistics (8 samples) give other losses than the global batch's
    assert max_dev(unsynced, ref) > 100 * (ATOL + RTOL * max(ref)), (unsynced, ref)
    runs = {f"{n} x2": r for n, r in two.items()} | {f"{n} x4": r for n, r in four.items()}
    deviations = {}
    for what, got in runs.items():
        deviations[what] = max_dev(got["losses"], ref)
        assert len(got["losses"]) == len(ref), what
        np.testing.assert_allclose(got["losses"], ref, rtol=RTOL, atol=ATOL, err_msg=what)
        assert got["running"].keys() == ref_run["running"].keys(), what
        for name, values in ref_run["running"].items():  # running statistics: the global batch's too
            np.testing.assert_allclose(got["running"][name], values, rtol=RTOL, atol=ATOL, err_msg=f"{what} {name}")
    print("max |loss - single| per strategy:", deviations, "unsynchronised ddp:", max_dev(unsynced, ref))


REFUSE = textwrap.dedent('''
    import torch, lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import lightning_par.strategies
    from lightning_par.parallel.contract import ParallelPlan

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.a, self.bn, self.b = nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 1)

        def parallel_plan(self):
            return ParallelPlan(layers=("a", "bn", "b"))

        def loss_fn(self, out, target):
            return out.pow(2).mean()

        def training_step(self, batch, batch_idx):
            return self.b(self.bn(self.a(batch[0]))).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    L.Trainer(strategy="lp_pipeline", devices=1, accelerator="cpu", max_steps=2, sync_batchnorm=True, logger=False,
              enable_progress_bar=False, enable_checkpointing=False).fit(
        Net(), DataLoader(TensorDataset(torch.randn(8, 6)), batch_size=4))
''')


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sync_batchnorm_under_a_pipeline_is_refused_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "refuse.py"
    script.write_text(REFUSE)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = launch.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: PipelineStrategy: sync_batchnorm cannot give BatchNorm the statistics of the global batch under a "
        "pipeline"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_unused_parameters(tmp_path: Path) -> None:
    # without the option: one line naming the parameters and our option, no torch traceback
    proc = run_script(tmp_path, 2, "branchy", ["lp_ddp"], timeout=300)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-4000:]
    assert errors[0].startswith("error: lp_ddp: parameter(s) aux.weight, aux.bias, never.weight, never.bias got no "
                                "gradient in a training step"), errors
    assert "Trainer(strategy=lightning_par.strategies.DDPStrategy(find_unused_parameters=True))" in errors[0]
    assert "strategy.find_unused_parameters=true" in errors[0]
    assert "Traceback" not in proc.stderr and "ddp_find_unused_parameters_true" not in proc.stderr, \
        proc.stderr[-4000:]
    # with it (and under the sharded strategies, which need none): lp_single's losses
    ref = results(tmp_path, 1, "branchy", ["lp_single"])["lp_single"]["losses"]
    assert len(ref) == 9 and ref[-1] < ref[0], ref
    two = results(tmp_path, 2, "branchy", ["lp_ddp_unused", "lp_zero1_unused", "lp_zero3", "lp_zero3_offload",
                                           "lp_fsdp"])
    for name, got in two.items():
        np.testing.assert_allclose(got["losses"], ref, rtol=1e-5, atol=1e-6, err_msg=name)
    print("max |loss - single| per strategy:", {n: max_dev(r["losses"], ref) for n, r in two.items()})
    # zero2 steps one flat shard: AdamW would move aux and never on the steps where no rank used them
    # (measured before refusing: 0.02 off lp_single from step 4); it stops in one line instead
    proc = run_script(tmp_path, 2, "branchy", ["lp_zero2"], timeout=300)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    # it says who stops as every other strategy's line does: the strategy's name (lp_zero2), not "zero2"
    assert errors == ["error: lp_zero2: parameter(s) aux.weight, aux.bias, never.weight, never.bias got no gradient "
                      "on any rank in a training step (unused, or in a branch not taken every step), which zero2's "
                      "flat optimizer shard cannot skip as torch's optimizers do; use zero3 or fsdp, or zero1 / ddp "
                      "with find_unused_parameters=True"], proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
