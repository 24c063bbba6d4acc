"""``MoEModule``: the GPT LightningModule with the mixture-of-experts decoder of ``moe.py``.

The training loss is the cross-entropy plus the MoE layers' auxiliary losses (load balance and
router z-loss, already scaled by their coefficients); both parts are logged (``train/ce``,
``train/aux``), and ``train/loss`` -- the loss the run summary records -- is their sum. Under a
pipeline the last stage computes only ``loss_fn(output, target)``: there each MoE layer feeds its
auxiliary loss into backward itself and the pipeline adds the stages' aux values to the loss it
reports (``parallel/contract.py`` ``AuxLossSource``), so ``train/loss`` is the same sum.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from lightning_par.models.moe import PRESETS, MoEConfig, MoEGPT
from lightning_par.models.module import GPTModule


class MoEModule(GPTModule):
    """Mixture-of-experts decoder trained on next-token prediction."""

    def __init__(self, preset: str | None = "moe_tiny", seq_len: int | None = None, **kwargs: Any) -> None:
        arch_keys = set(MoEConfig.__dataclass_fields__)
        arch = {k: kwargs.pop(k) for k in list(kwargs) if k in arch_keys}
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"MoEModule: unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        super().__init__(preset=None, seq_len=seq_len or 1, **kwargs)
        fields = dict(PRESETS[preset]) if preset else {}
        fields.update(arch)
        self.config = MoEConfig(**fields)
        self.seq_len = seq_len or self.config.block_size
        if self.seq_len > self.config.block_size:
            raise ValueError(f"MoEModule: seq_len={self.seq_len} exceeds block_size={self.config.block_size}")
        self.save_hyperparameters()

    def build_net(self, device: torch.device | str | None = "meta") -> nn.Module:
        with torch.device(device) if device is not None else nullcontext():
            return MoEGPT(self.config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        ce = self.loss_fn(self(x), y)
        aux = self.net.aux_loss()
        loss = ce if aux is None else ce + aux
        self.log("train/loss", loss)
        self.log("train/ce", ce)
        if aux is not None:
            self.log("train/aux", aux)
        return loss
