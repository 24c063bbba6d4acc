"""``callbacks.export.at_end=true``: the trained model as a transformers directory when training ends.

Every rank takes part (``export.save_pretrained``: a weights-only sharded checkpoint, exported tensor
by tensor by global rank 0); the line it printed goes to the run's log. Off by default: an export
costs a checkpoint's worth of disk and time.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L

from lightning_par.strategies.checkpoint.export import save_pretrained, size_bytes

log = logging.getLogger(__name__)


class ExportAtEnd(L.Callback):
    """Export at the end of ``fit`` to ``output_dir`` when ``at_end``.

    Args:
        at_end: export when training ends.
        output_dir: the transformers directory to write (replaced if it exists).
        dtype: ``keep`` (the training dtype), ``bf16``, ``fp16`` or ``fp32``.
        max_shard_size: largest safetensors file, e.g. ``5GB``.
    """

    def __init__(self, at_end: bool = False, output_dir: str = "hf", dtype: str = "keep",
                 max_shard_size: str = "5GB") -> None:
        self.at_end, self.output_dir, self.dtype = at_end, output_dir, dtype
        self.max_shard_bytes = size_bytes(max_shard_size)  # a bad size is one line at construction

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.at_end:
            return
        line = save_pretrained(trainer, self.output_dir, dtype=self.dtype, max_shard_bytes=self.max_shard_bytes)
        if trainer.is_global_zero:
            log.info(line)
            print(line)

    def state_dict(self) -> dict[str, Any]:
        return {}
