"""Validation perplexity: ``exp`` of the epoch's mean validation loss, logged beside ``val/loss``.

The exponential of the mean, not a mean of per-batch exponentials (which overstates it), so it is
computed once the epoch's ``val/loss`` is final: in ``on_validation_end``, after Lightning has
reduced the epoch's values over batches and ranks (whichever path logged them: the module's own
``validation_step``, a pipeline's, or loss-parallel's).
"""

from __future__ import annotations

import math

import lightning as L
import torch


class ValPerplexity(L.Callback):
    """Logs ``val/perplexity`` = exp(``val/loss``) to every logger and ``trainer.callback_metrics``."""

    def __init__(self, loss_key: str = "val/loss", key: str = "val/perplexity") -> None:
        self.loss_key, self.key = loss_key, key

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.loss_key not in trainer.callback_metrics:
            return
        loss = float(trainer.callback_metrics[self.loss_key])
        value = math.exp(loss) if loss < 700 else math.inf  # exp overflows a float above ~709
        trainer.callback_metrics[self.key] = torch.tensor(value)
        # through Lightning's own logger connector: the same step and epoch as the val/loss row it wrote
        # (no public call takes a metric after the epoch's reduction; loggers write on rank 0 only)
        trainer._logger_connector.log_metrics({self.key: value})
