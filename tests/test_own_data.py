"""A user's own DataModule in the app, and lightning_par's callbacks in a user's own Trainer.

- The app's data modules split the data along the data-parallel axis themselves; a DataModule of
  the user's (picked through Hydra's search path) gets Lightning's distributed sampler with the
  strategy's data-parallel rank and size. Proof: ddp on 2 ranks with 8 samples per rank equals ddp
  on one rank with 16 per step (SGD, rtol 1e-6; one rank, so Lightning's sampler shuffles the same
  order); were every rank fed the same 8 samples, the losses would be those of one rank with 8,
  which differ from step 0 (checked too, so the comparison can fail).
- ``RunSummary``/``ThroughputMonitor`` work with a plain DataLoader: the global batch comes from the
  loader's batch size x data-parallel size x accumulation.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests import launch
from tests.helpers import ROOT, run_cli

DM = textwrap.dedent('''
    import lightning as L, torch
    from torch.utils.data import DataLoader, TensorDataset

    class MyDM(L.LightningDataModule):
        def __init__(self, batch_size=8):
            super().__init__()
            self.batch_size = batch_size

        def setup(self, stage=None):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(1024, 32, generator=g)
            self.ds = TensorDataset(x, (x[:, :10] @ torch.randn(10, 10, generator=g)).argmax(-1))

        def train_dataloader(self):
            return DataLoader(self.ds, batch_size=self.batch_size, shuffle=False)
''')


def _app(tmp_path: Path, name: str, devices: int, batch: int) -> dict:
    run_dir = tmp_path / name
    args = [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "data=mine", f"data.batch_size={batch}", "model=mlp",
            "model.optimizer=sgd", "model.lr=0.1", "strategy=ddp",
            f"trainer.devices={devices}", "trainer.max_steps=12", "trainer.limit_val_batches=0",
            "trainer.enable_progress_bar=false"]
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env_path}" if env_path else str(tmp_path)
    try:
        run_cli(args, run_dir, timeout=240)
    finally:
        os.environ["PYTHONPATH"] = env_path
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_users_datamodule_is_sharded_over_data_parallel_ranks(tmp_path: Path) -> None:
    (tmp_path / "my_dm.py").write_text(DM)
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "mine.yaml").write_text("_target_: my_dm.MyDM\nbatch_size: 8\n")
    one16 = _app(tmp_path, "one16", 1, 16)
    one8 = _app(tmp_path, "one8", 1, 8)
    two = _app(tmp_path, "two", 2, 8)
    assert (one16["global_batch_size"], one8["global_batch_size"], two["global_batch_size"]) == (16, 8, 16)
    assert len(two["losses"]) == 12
    np.testing.assert_allclose(two["losses"], one16["losses"], rtol=1e-6)
    # what every rank reading the same 8 samples would give: measurably different
    assert abs(one8["losses"][0] - one16["losses"][0]) > 1e-3


SCRIPT = textwrap.dedent('''
    import sys, torch, lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import lightning_par.strategies
    from lightning_par.callbacks import MemoryMonitor, RunSummary, ThroughputMonitor

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 2)

        def training_step(self, b, i):
            return nn.functional.cross_entropy(self.l(b[0]), b[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
    L.Trainer(strategy="lp_ddp", devices=2, accelerator="cpu", max_steps=15, logger=False, enable_progress_bar=False,
              enable_checkpointing=False, accumulate_grad_batches=2,
              callbacks=[RunSummary(output_dir=sys.argv[1]), ThroughputMonitor(), MemoryMonitor()]
              ).fit(M(), DataLoader(data, batch_size=4))
''')


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_callbacks_in_a_users_trainer_with_a_plain_dataloader(tmp_path: Path) -> None:
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = launch.run([sys.executable, str(script), str(tmp_path / "out")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["global_batch_size"] == 4 * 2 * 2 and summary["steps"] == 15
    assert summary["samples_per_s"] > 0 and len(summary["memory"]) == 2
