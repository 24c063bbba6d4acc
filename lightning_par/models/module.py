"""The LightningModules of the demo models.

``ParModule`` is a plain LightningModule around an architecture (``self.net``): batches are
``(inputs, targets)``, the loss is ``loss_fn(net(inputs), targets)``, the optimizer is built from
plain arguments. It holds no parallelism; it implements the model contract
(``parallel/contract.py``): ``parallel_plan()`` (the net's plan, with paths rooted at this module),
``loss_fn`` (which a pipeline's last stage needs on its own), ``example_input`` and
``init_weights``. The architecture is built in Lightning's ``configure_model()`` hook, which
lightning_par's strategies run on the meta device: the strategy cuts and shards the empty model and
then materialises only this rank's part with ``init_weights``.
"""

from __future__ import annotations

import dataclasses
import io
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_par import ConfigError
from lightning_par.models.cnn import CNN
from lightning_par.core.logging_steps import logs_this_step
from lightning_par.models.gpt import GPT, PRESETS, GPTConfig
from lightning_par.models.mlp import MLPNet
from lightning_par.core.optim import (OptimizerConfig, ScheduleConfig, build_optimizer, build_scheduler, schedule_config,
                                 scaled_lr)
from lightning_par.parallel.adapters.lora import apply_lora, lora_option
from lightning_par.parallel.contract import ParallelPlan
from lightning_par.parallel.memory.chunked_loss import chunked_head, chunked_loss_option, make_chunked


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits ``output`` (..., V), upcast to fp32, against ``target``."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))


class ParModule(L.LightningModule):
    #: what the model consumes: "tokens" (B, T) int64, "vectors" (B, D) float, "images" (B, C, H, W) float
    input_kind: str = "tokens"

    def __init__(
        self,
        optimizer: str = "adamw",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        momentum: float = 0.9,
        scheduler: dict[str, Any] | ScheduleConfig | None = None,
        global_batch_size: int | None = None,
        chunked_loss: bool | int = False,
        lora: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        OptimizerConfig(optimizer)  # unknown names (and adamw8bit without torchao) fail here, in one line
        try:
            #: the head and the loss a chunk of tokens at a time (``parallel/memory/chunked_loss.py``; None: off)
            self.chunked_loss = chunked_loss_option(chunked_loss)
        except ValueError as e:
            raise ConfigError(f"model.{e}") from None
        try:
            #: low-rank adapters on the frozen model (``parallel/adapters/lora.py``; None: full fine-tuning)
            self.lora = lora_option(lora)
        except ValueError as e:
            raise ConfigError(f"model.{e}") from None
        if self.chunked_loss is not None and self.input_kind != "tokens":
            raise ConfigError(f"model.chunked_loss: {type(self).__name__} has no output layer over a vocabulary")
        self.optimizer_name = optimizer
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = tuple(betas)
        self.momentum = momentum
        self.schedule = scheduler if isinstance(scheduler, ScheduleConfig) else schedule_config(scheduler)
        self.global_batch_size = global_batch_size
        self.net: nn.Module | None = None

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Lightning's ``load_from_checkpoint``, which also opens lightning_par's sharded checkpoint
        directories: their tensors are assembled into one state dict in this process (the whole model
        in host memory, as Lightning's own file holds it; ``lightning-par-export`` streams instead)."""
        path = Path(str(checkpoint_path)) if isinstance(checkpoint_path, (str, os.PathLike)) else None
        if path is not None and path.is_dir():
            from lightning.fabric.utilities.load import _load_distributed_checkpoint

            from lightning_par.strategies.checkpoint.dcp import check_checkpoint, lightning_checkpoint

            check_checkpoint(path)
            buffer = io.BytesIO()
            torch.save(lightning_checkpoint(_load_distributed_checkpoint(path)), buffer)
            buffer.seek(0)
            checkpoint_path = buffer
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    def set_schedule(self, schedule: ScheduleConfig, global_batch_size: int | None) -> None:
        """The ``scheduler`` config group and the run's global batch (for ``schedule.lr_scaling``)."""
        self.schedule, self.global_batch_size = schedule, global_batch_size

    def configure_model(self) -> None:
        """Build the architecture once, on whatever device is current (the meta device under
        lightning_par's strategies; real tensors under Lightning's own)."""
        if self.net is None:
            self.net = self.chunk_head(self.adapt(self.build_net(device=None)))

    def adapt(self, net: nn.Module) -> nn.Module:
        """``net`` with LoRA adapters on its target linears and the rest frozen, when ``lora`` is on (the
        output layer is never adapted)."""
        if self.lora is not None:
            getter = getattr(net, "get_output_embeddings", None)
            head = getter() if callable(getter) else None
            try:
                apply_lora(net, self.lora, exclude=[head] if head is not None else [])
            except ValueError as e:
                raise ConfigError(f"model.{e}") from None
        return net

    def chunk_head(self, net: nn.Module) -> nn.Module:
        """``net`` with its output layer (``get_output_embeddings()``) made a chunked head when ``chunked_loss``
        is on: the forward then returns the hidden states and ``loss_fn`` projects them chunk by chunk."""
        if self.chunked_loss is not None:
            getter = getattr(net, "get_output_embeddings", None)
            layer = getter() if callable(getter) else None
            if layer is None:
                raise ConfigError(f"model.chunked_loss: {type(net).__name__} names no output layer "
                                  "(get_output_embeddings)")
            try:
                make_chunked(layer, self.chunked_loss)
            except ValueError as e:
                raise ConfigError(f"model.{e}") from None
        return net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits; with ``chunked_loss``, the hidden states the output layer would project."""
        return self.net(x)

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every prediction (tokens or samples); with ``chunked_loss`` the output
        layer projects ``output`` (hidden states) a chunk at a time (a pipeline stage without it: the plain loss,
        never called there)."""
        head = chunked_head(self.net) if self.chunked_loss is not None and self.net is not None else None
        if head is not None:
            return head.loss(output, target)
        return cross_entropy(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        # not prog_bar: Lightning turns progress-bar values into Python floats every step (a host
        # synchronisation); the loggers get it every log_every_n_steps, summary.json every step
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def training_lr(self) -> float:
        """``lr`` after the schedule's batch-size scaling rule (``lightning_par/core/optim.py``)."""
        s = self.schedule
        if s.lr_scaling == "none":
            return self.lr
        if not self.global_batch_size:
            raise ConfigError(f"scheduler.lr_scaling={s.lr_scaling} needs the run's global batch size")
        return scaled_lr(self.lr, self.global_batch_size, s.lr_scaling, s.base_batch_size)

    def configure_optimizers(self) -> Any:
        """The optimizer factory's optimizer (``lightning_par/core/optim.py``) and, unless the schedule is
        ``constant``, its per-step LR scheduler."""
        cfg = OptimizerConfig(self.optimizer_name, lr=self.training_lr(), weight_decay=self.weight_decay,
                              betas=self.betas, momentum=self.momentum)
        optimizer = build_optimizer(self.parameters(), cfg)
        total = self.schedule.total_steps or (self.trainer.estimated_stepping_batches if self._trainer else None)
        scheduler = build_scheduler(optimizer, self.schedule, int(total) if total else None)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # the LR of this step (a Python float: no device sync), only on the steps the loggers write
        if logs_this_step(self.trainer):
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, on_epoch=False)

    def parallel_plan(self) -> ParallelPlan:
        net = self.net if self.net is not None else self.build_net(device="meta")
        return net.parallel_plan().prefixed("net")

    def init_weights(self, module: nn.Module) -> None:
        """Initialise the tensors ``module`` itself owns: the architecture's own rule where it has one,
        else the module's ``reset_parameters()``."""
        net_init = getattr(self.net, "init_weights", None)
        if callable(net_init):
            net_init(module)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()

    def example_input(self, batch_size: int, device: torch.device | str = "meta") -> torch.Tensor:
        """A batch of the right shape (used to count FLOPs on the meta device)."""
        raise NotImplementedError

    def build_net(self, device: torch.device | str | None = "meta") -> nn.Module:
        """A fresh copy of the architecture on ``device`` (None: the current default device)."""
        raise NotImplementedError


class GPTModule(ParModule):
    """GPT-style decoder trained on next-token prediction."""

    input_kind = "tokens"

    def __init__(self, preset: str | None = "gpt_small", seq_len: int | None = None, **kwargs: Any) -> None:
        arch_keys = set(GPTConfig.__dataclass_fields__)
        arch = {k: kwargs.pop(k) for k in list(kwargs) if k in arch_keys}
        super().__init__(**kwargs)
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"GPTModule: unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        fields = dict(PRESETS[preset]) if preset else {}
        fields.update(arch)
        self.config = GPTConfig(**fields)
        self.seq_len = seq_len or self.config.block_size
        if self.seq_len > self.config.block_size:
            raise ValueError(f"GPTModule: seq_len={self.seq_len} exceeds block_size={self.config.block_size}")
        self.save_hyperparameters()

    def example_input(self, batch_size: int, device: torch.device | str = "meta") -> torch.Tensor:
        return torch.zeros(batch_size, self.seq_len, dtype=torch.long, device=device)

    def cost_shape(self, seq_len: int | None = None) -> dict[str, Any]:
        """What the cost model prices this model by (``costs/shape.Shape.of_model`` reads it; the models
        sit below ``costs/``, so they name what to read): a GPT of this config (an ``MoEConfig``: its
        experts too) at ``seq_len`` tokens (None: ``block_size``), with its attention backend and dropout (what
        the attention check before launch reads: ``models/attention.check_device``)."""
        return {"family": "gpt", "config": self.config, "seq_len": seq_len or self.config.block_size,
                "loss_chunk": self.chunked_loss.chunk_tokens if self.chunked_loss else 0,
                "attn_implementation": self.config.attn_implementation, "dropout": float(self.config.dropout)}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The architecture rides in the checkpoint: ``lightning-par-export`` writes it as GPT-2."""
        if type(self.config) is GPTConfig:  # the MoE model's config is another architecture
            checkpoint["gpt_config"] = dataclasses.asdict(self.config)

    def build_net(self, device: torch.device | str | None = "meta") -> nn.Module:
        with torch.device(device) if device is not None else nullcontext():
            return GPT(self.config)


class MLPModule(ParModule):
    """MLP classifier on synthetic vectors."""

    input_kind = "vectors"

    def __init__(self, in_dim: int = 32, hidden: int = 256, depth: int = 4, n_classes: int = 10, **kwargs: Any):
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.arch = dict(in_dim=in_dim, hidden=hidden, depth=depth, n_classes=n_classes)

    def example_input(self, batch_size: int, device: torch.device | str = "meta") -> torch.Tensor:
        return torch.zeros(batch_size, self.arch["in_dim"], device=device)

    def build_net(self, device: torch.device | str | None = "meta") -> nn.Module:
        with torch.device(device) if device is not None else nullcontext():
            return MLPNet(**self.arch)


class CNNModule(ParModule):
    """Small CNN with BatchNorm on synthetic images (the SyncBatchNorm case)."""

    input_kind = "images"

    def __init__(self, in_channels: int = 3, channels: tuple[int, ...] = (16, 32), n_classes: int = 10,
                 image_size: int = 16, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.arch = dict(in_channels=in_channels, channels=tuple(channels), n_classes=n_classes)
        self.image_size = image_size

    def example_input(self, batch_size: int, device: torch.device | str = "meta") -> torch.Tensor:
        s = self.image_size
        return torch.zeros(batch_size, self.arch["in_channels"], s, s, device=device)

    def build_net(self, device: torch.device | str | None = "meta") -> nn.Module:
        with torch.device(device) if device is not None else nullcontext():
            return CNN(**self.arch)
