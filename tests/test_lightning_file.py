"""A Lightning single-file checkpoint resumes under lp_ strategies (issue 20, part 5).

Lightning's own ``DDPStrategy`` (2 ranks, a LightningModule written here, AdamW) trains 8 steps,
saving its ordinary ``.ckpt`` file at step 4 (the end of epoch 1: a plain DataLoader has no
mid-epoch position to restore). That file resumes under lp_ddp, lp_zero1, lp_zero2, lp_zero3,
lp_fsdp and lp_pipeline (two stages, each rank holding half the layers) at 2 ranks: the model, AdamW's moments and the loop state are carried over, and steps 5-8
equal Lightning's uninterrupted run (rtol 1e-5). A file from another model is one line.
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

ROOT = Path(__file__).resolve().parents[1]
RESUMED = ["lp_ddp", "lp_zero1", "lp_zero2", "lp_zero3", "lp_fsdp", "lp_pipeline"]

SCRIPT = textwrap.dedent('''
    import json, os, sys, warnings, logging
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    from torch import nn
    import torch.nn.functional as F
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset
    import lightning_par.strategies

    class Net(L.LightningModule):
        def __init__(self, width=32):
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Embedding(64, width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 64))

        def parallel_plan(self):  # where a pipeline may cut it (the data-parallel strategies ignore it)
            from lightning_par.parallel.contract import ParallelPlan
            return ParallelPlan(layers=("net.0", "net.1", "net.2", "net.3"))

        def loss_fn(self, logits, target):  # a pipeline's last stage computes the loss with it
            return F.cross_entropy(logits.flatten(0, 1), target.flatten())

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    class Losses(L.Callback):
        def __init__(self):
            self.values = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.values.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    root, cells = sys.argv[1], json.loads(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (32, 9), generator=g)
    data = TensorDataset(ids[:, :-1], ids[:, 1:])  # 32 samples, 4 per rank per step: 4 steps per epoch
    out = {}
    for strategy, ckpt, width in cells:
        L.seed_everything(0, verbose=False)
        losses = Losses()
        callbacks = [losses]
        if ckpt is None:
            callbacks.append(ModelCheckpoint(dirpath=f"{root}/files", filename="step{step}", every_n_train_steps=4,
                                             save_top_k=-1, auto_insert_metric_name=False))
        trainer = L.Trainer(strategy=strategy, devices=2, accelerator="cpu", max_steps=8, callbacks=callbacks,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=ckpt is None)
        try:
            batch = 8 if strategy == "lp_pipeline" else 4  # the same global batch: a pipeline has one data rank
            trainer.fit(Net(width), DataLoader(data, batch_size=batch), ckpt_path=ckpt)
            out[f"{strategy}/{width}"] = losses.values
        except ValueError as e:
            out[f"{strategy}/{width}"] = {"error": str(e)}
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        with open(f"{root}/out_{len(cells)}.json", "w") as f:
            json.dump(out, f)
''')


def _run(root: Path, cells: list) -> dict:
    script = root / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = launch.run([sys.executable, str(script), str(root), json.dumps(cells)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((root / f"out_{len(cells)}.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lightning_ddp_file_resumes_under_every_data_parallel_strategy(tmp_path: Path) -> None:
    whole = _run(tmp_path, [["ddp", None, 32]])["ddp/32"]
    ckpt = str(tmp_path / "files" / "step4.ckpt")
    assert Path(ckpt).is_file() and len(whole) == 8
    got = _run(tmp_path, [[s, ckpt, 32] for s in RESUMED] + [["lp_fsdp", ckpt, 48]])
    for strategy in RESUMED:
        losses = got[f"{strategy}/32"]
        assert isinstance(losses, list) and len(losses) == 4, (strategy, losses)  # steps 5-8 only: it resumed
        np.testing.assert_allclose(losses, whole[4:], rtol=1e-5, atol=1e-6, err_msg=strategy)
    error = got["lp_fsdp/48"]["error"]  # the file of a width-32 model under a width-48 one
    assert "step4.ckpt" in error and len(error.splitlines()) == 1, error
