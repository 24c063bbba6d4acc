"""The run's checkpoints: ``callbacks.checkpoint`` (``conf/callbacks/default.yaml``).

``RunCheckpoint`` is Lightning's ``ModelCheckpoint`` (every ``every_n_train_steps`` optimizer steps, as
``<run dir>/checkpoints/stepNNNNNN.ckpt``: a sharded directory under lightning_par's strategies) that also
writes one at the last step when that step's is not written already (``at_end``), so the trained
weights are always on disk when ``fit`` returns.

Whether a run writes checkpoints is ``trainer.enable_checkpointing``: ``null`` (the default) means on for
a fine-tune (``model.pretrained`` set: its result is what the run is for, and ``lightning-par-export``
reads a checkpoint) and off otherwise; ``callbacks=checkpoint`` sets ``true`` (every run); ``false``: none
(``checkpointing`` below; the app's ``train.build`` applies it).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` (every argument is Lightning's) plus ``at_end``: also save at the last step."""

    def __init__(self, *args: Any, at_end: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.at_end = bool(at_end)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        # skipped when this step's checkpoint exists already (a multiple of every_n_train_steps), or no step ran
        if self.at_end and trainer.global_step > 0 and not self._should_skip_saving_checkpoint(trainer):
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))


def checkpointing(callbacks: list[Any], finetune: bool, setting: bool | None) -> tuple[list[Any], bool]:
    """The callbacks to run and the Trainer's ``enable_checkpointing``, from ``trainer.enable_checkpointing``
    (``setting``): ``None`` keeps the ``RunCheckpoint`` only for a fine-tune, ``True`` keeps it, ``False``
    drops it. Unset, the Trainer's flag is whether any ``ModelCheckpoint`` is left (Lightning refuses one
    with the flag off, and adds its own with the flag on)."""
    on = finetune if setting is None else bool(setting)
    kept = [cb for cb in callbacks if on or not isinstance(cb, RunCheckpoint)]
    enable = bool(setting) if setting is not None else any(isinstance(cb, ModelCheckpoint) for cb in kept)
    return kept, enable
