"""Validation perplexity (issue 20, part 3): exp of the epoch's mean val/loss, in the same logger row."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.callbacks.perplexity import ValPerplexity


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 16)

    def _loss(self, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.emb(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_perplexity_is_exp_of_the_epoch_mean_loss(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (32, 9), generator=g)
    data = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=4)
    logger = L.pytorch.loggers.CSVLogger(tmp_path)
    trainer = L.Trainer(max_steps=6, val_check_interval=3, limit_val_batches=3, logger=logger, callbacks=[ValPerplexity()],
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        accelerator="cpu", num_sanity_val_steps=1)
    trainer.fit(Tiny(), data, data)
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    losses = {r["step"]: float(r["val/loss"]) for r in rows if r.get("val/loss")}
    ppl = {r["step"]: float(r["val/perplexity"]) for r in rows if r.get("val/perplexity")}
    assert len(losses) == 2 and set(ppl) == set(losses), rows  # not logged in the sanity check
    for step, loss in losses.items():
        assert math.isclose(ppl[step], math.exp(loss), rel_tol=1e-6), (step, loss, ppl[step])
    assert math.isclose(float(trainer.callback_metrics["val/perplexity"]), ppl[max(ppl, key=int)], rel_tol=1e-6)
