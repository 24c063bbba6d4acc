"""Throughput and MFU.

Step time is the wall time between consecutive optimizer-step ends (so it includes data loading,
forward, backward, communication and the optimizer). FLOPs per optimizer step come from torch's
FLOP counter (through Lightning's ``measure_flops``) run once on a meta-device copy of the model's
architecture -- forward and backward for the whole global batch, no real compute. MFU divides the
achieved model FLOP/s by the device peak from Lightning's ``get_available_flops`` table times the
number of ranks; where the peak is unknown (CPU), MFU is null. Per-step figures also go to the logger.

Why not Lightning's ``ThroughputMonitor`` / ``Throughput`` (we do use their ``measure_flops`` and
``get_available_flops``): (1) they turn per-device figures into global ones by multiplying by the
world size, which over-counts samples and FLOPs by tp x pp under tensor and pipeline parallelism,
where the ranks of one data-parallel group read the same batch -- here samples per step are the
configured global batch, and FLOPs are counted once for it; (2) they report rolling means over a
window of steps, while the run summary's ``step_time_s`` is the median after warm-up (robust to
steps that include a checkpoint save or a validation pass), and a per-step value goes to the logger.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops, measure_flops

_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32, "64": torch.float64}


def precision_dtype(precision: str) -> torch.dtype:
    return _DTYPES.get(str(precision).split("-")[0], torch.float32)


def model_flops_per_batch(pl_module: L.LightningModule, batch_size: int) -> int | None:
    """Training FLOPs (forward + backward) of one batch, counted on a meta copy; None if unknown."""
    build = getattr(pl_module, "build_net", None)
    example = getattr(pl_module, "example_input", None)
    if not callable(build) or not callable(example):
        return None
    try:
        net = build("meta")
        x = example(batch_size, "meta")
    except NotImplementedError:
        return None
    return int(measure_flops(net, lambda: net(x), lambda y: y.float().sum()))


class ThroughputMonitor(L.Callback):
    """Step time, samples/s, tokens/s and MFU.

    Args:
        warmup_steps: optimizer steps excluded from the step-time median (first steps pay one-off costs).
    """

    def __init__(self, warmup_steps: int = 3) -> None:
        self.warmup_steps = warmup_steps
        self.step_times: list[float] = []
        self._last: float | None = None
        self._step_seen = -1
        self.flops_per_step: int | None = None
        self.peak_flops_per_rank: int | None = None
        self.global_batch_size: int = 0
        self.tokens_per_sample: int = 0
        self.world_size = 1

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dm = trainer.datamodule
        self.global_batch_size = int(getattr(dm, "global_batch_size", 0) or 0)
        self.tokens_per_sample = int(getattr(dm, "seq_len", 0) or 0) if getattr(dm, "kind", "") == "tokens" else 0
        self.world_size = trainer.world_size
        self.step_times, self._last, self._step_seen = [], None, trainer.global_step
        if self.global_batch_size:
            self.flops_per_step = model_flops_per_batch(pl_module, self.global_batch_size)
        self.peak_flops_per_rank = None
        if pl_module.device.type == "cuda":
            self.peak_flops_per_rank = get_available_flops(pl_module.device, precision_dtype(trainer.precision))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        if self._last is None:
            self._last = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._step_seen:  # still accumulating
            return
        self._step_seen = trainer.global_step
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        dt = now - self._last
        self._last = now
        self.step_times.append(dt)
        metrics = {"perf/step_time_s": dt}
        if self.global_batch_size:
            metrics["perf/samples_per_s"] = self.global_batch_size / dt
        if self.flops_per_step and self.peak_flops_per_rank:
            metrics["perf/mfu"] = self.flops_per_step / dt / (self.peak_flops_per_rank * self.world_size)
        pl_module.log_dict(metrics, rank_zero_only=True)

    def summary(self) -> dict[str, Any]:
        measured = self.step_times[self.warmup_steps :] or self.step_times
        if not measured:
            return {"step_time_s": None, "samples_per_s": None, "tokens_per_s": None, "mfu": None}
        step = statistics.median(measured)
        samples = self.global_batch_size / step if self.global_batch_size else None
        tokens = samples * self.tokens_per_sample if samples and self.tokens_per_sample else None
        mfu = None
        if self.flops_per_step and self.peak_flops_per_rank:
            mfu = self.flops_per_step / step / (self.peak_flops_per_rank * self.world_size)
        return {"step_time_s": step, "samples_per_s": samples, "tokens_per_s": tokens, "mfu": mfu,
                "flops_per_step": self.flops_per_step}
