"""Throughput and MFU.

Step time is the wall time between consecutive optimizer-step ends (so it includes data loading,
forward, backward, communication and the optimizer). FLOPs per optimizer step come from torch's
FLOP counter (through Lightning's ``measure_flops``) run once on a meta-device copy of the model's
architecture -- forward and backward for the whole global batch, no real compute; a Hugging Face MoE
copy counts the routed work, each token through its top-k experts (``parallel/hf_flops.py``). A model
that cannot be counted so (an op the meta device cannot run) is not an error: its MFU is null and the
summary's ``mfu_note`` says why in one line. MFU divides the achieved model FLOP/s by the dense
device peak for the dtype the matmuls run in (``matmul_dtype``: FSDP's ``param_dtype`` when the
strategy sets one, else the trainer's precision; peaks from ``lightning_par/devices.py``, or
``peak_tflops`` to override) times the number of ranks; where the peak is unknown (CPU), MFU is null.

No host synchronisation per step: on CUDA the device is synchronised only every
``every_n_steps`` optimizer steps (default 10), and a window's time divided by its steps is the
step time of each of its steps; on CPU, where the work is synchronous, every step is timed on its
own. Windows that start within the first ``warmup_steps`` steps are left out of the median. Window
figures also go to the logger.

Why not Lightning's ``ThroughputMonitor`` / ``Throughput`` (we do use their ``measure_flops`` and
``get_available_flops``): (1) they turn per-device figures into global ones by multiplying by the
world size, which over-counts samples and FLOPs by tp x pp under tensor and pipeline parallelism,
where the ranks of one data-parallel group read the same batch -- here samples per step are the
configured global batch, and FLOPs are counted once for it; (2) they report rolling means over a
window of steps, while the run summary's ``step_time_s`` is the median after warm-up (robust to
steps that include a checkpoint save or a validation pass), and a per-step value goes to the logger.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import measure_flops

from lightning_par import dtypes
from lightning_par.devices import peak_flops_per_device
from lightning_par.logging_steps import logs_this_step

log = logging.getLogger(__name__)


def precision_dtype(precision: str | int) -> torch.dtype:
    """The dtype matmuls run in under a Lightning precision (``lightning_par/dtypes.py``); fp32 for
    one the table lacks (e.g. bitsandbytes' ``nf4``)."""
    try:
        return dtypes.precision(precision).compute
    except ValueError:
        return torch.float32


def matmul_dtype(trainer: L.Trainer) -> torch.dtype:
    """The dtype the model's matmuls run in: FSDP mixed precision's ``param_dtype`` if the strategy
    has one (any spelling of ``lightning_par/dtypes.py``: bf16, bfloat16, torch.bfloat16 ...), else
    what the trainer's precision computes in (bf16-mixed: bf16, 32-true: fp32)."""
    param_dtype = getattr(trainer.strategy, "param_dtype", None)
    if param_dtype:
        try:
            return dtypes.to_dtype(param_dtype, "param_dtype")
        except ValueError:  # not ours to refuse here (the strategy checks its own options)
            pass
    return precision_dtype(trainer.precision)


def count_model_flops(pl_module: L.LightningModule, batch_size: int) -> tuple[int | None, str | None]:
    """Training FLOPs (forward + backward) of one batch, counted on a meta copy: ``(flops, None)``, or
    ``(None, why not)`` in one line. Never raises: a model the meta device cannot run only loses its MFU.

    A Hugging Face MoE copy runs its experts with ``batched_mm`` first (``parallel/hf_flops.py``), so
    the count is the routed work (each token through its top-k experts); one whose experts cannot be
    counted so is refused rather than counted as all experts on every token."""
    from lightning_par.parallel.hf_flops import FlopsUnknown, route_experts_for_counting

    build = getattr(pl_module, "build_net", None)
    example = getattr(pl_module, "example_input", None)
    name = type(pl_module).__name__
    if not callable(build) or not callable(example):
        return None, f"FLOPs not counted: {name} has no build_net(device) and example_input(batch_size, device)"
    try:
        net = build("meta")
        x = example(batch_size, "meta")
    except NotImplementedError as e:  # ParModule's defaults: the model builds no meta copy
        return None, f"FLOPs not counted: {name} builds no meta copy ({_one_line(e)})"
    except Exception as e:  # noqa: BLE001 - a measurement: whatever fails, the run goes on without it
        return None, f"FLOPs not counted: building {name}'s meta copy failed ({_one_line(e)})"
    try:
        route_experts_for_counting(net)
        return int(measure_flops(net, lambda: net(x), lambda y: y.float().sum())), None
    except FlopsUnknown as e:
        return None, f"FLOPs not counted: {e}"
    except Exception as e:  # noqa: BLE001 - e.g. an op without a meta kernel, or a data-dependent one (nonzero)
        return None, f"FLOPs not counted: running {name} on the meta device failed ({_one_line(e)})"


def model_flops_per_batch(pl_module: L.LightningModule, batch_size: int) -> int | None:
    """Training FLOPs (forward + backward) of one batch, counted on a meta copy; None if unknown
    (``count_model_flops`` says why)."""
    return count_model_flops(pl_module, batch_size)[0]


def _one_line(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def global_batch_of(trainer: L.Trainer) -> int | None:
    """Samples per optimizer step over all data-parallel ranks: the data module's
    ``global_batch_size`` (lightning_par's data modules), else the training loader's batch size times
    the data-parallel size and gradient accumulation (a user's DataModule or plain DataLoader, once
    the loaders exist); None when neither is known."""
    declared = getattr(trainer.datamodule, "global_batch_size", None)
    if declared:
        return int(declared)
    loader = getattr(trainer.fit_loop, "_combined_loader", None)
    loader = loader.iterables if loader is not None else None
    batch = getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if not batch:
        return None
    try:
        dp = int(trainer.strategy.distributed_sampler_kwargs.get("num_replicas", trainer.world_size))
    except (AttributeError, TypeError):  # strategies without data-parallel ranks
        dp = trainer.world_size
    return int(batch) * dp * int(trainer.accumulate_grad_batches)


class ThroughputMonitor(L.Callback):
    """Step time, samples/s, tokens/s and MFU.

    Args:
        warmup_steps: optimizer steps excluded from the step-time median (first steps pay one-off costs).
        every_n_steps: on CUDA, synchronise and time every this many optimizer steps (None: 10); on
            CPU every step is timed (there is nothing to synchronise).
        peak_tflops: the device's peak TFLOP/s for MFU, instead of the built-in table.
    """

    def __init__(self, warmup_steps: int = 3, every_n_steps: int | None = None,
                 peak_tflops: float | None = None) -> None:
        if every_n_steps is not None and int(every_n_steps) < 1:
            raise ValueError(f"ThroughputMonitor: every_n_steps={every_n_steps} must be >= 1")
        self.warmup_steps = warmup_steps
        self.every_n_steps = every_n_steps
        self.peak_tflops = peak_tflops
        #: timed windows: (first step after the window's start, steps in it, seconds per step)
        self.windows: list[tuple[int, int, float]] = []
        self._open: tuple[float, int] | None = None  # the open window: (start time, global step at its start)
        self._step_seen = -1
        self._start_step = 0
        self._every = 1
        self._cuda: torch.device | None = None
        self.flops_per_step: int | None = None
        self.flops_note: str | None = None  # why flops_per_step (and so MFU) is unknown
        self.peak_flops_per_rank: float | None = None
        self.matmul_dtype: torch.dtype | None = None
        self.global_batch_size: int = 0
        self.tokens_per_sample: int = 0
        self.world_size = 1

    @property
    def step_times(self) -> list[float]:
        """Seconds per optimizer step, one entry per timed step."""
        return [dt for _, n, dt in self.windows for _ in range(n)]

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dm = trainer.datamodule
        self.tokens_per_sample = int(getattr(dm, "seq_len", 0) or 0) if getattr(dm, "kind", "") == "tokens" else 0
        self.world_size = trainer.world_size
        self.windows, self._open = [], None
        self._step_seen = self._start_step = trainer.global_step
        self._cuda = pl_module.device if pl_module.device.type == "cuda" else None
        self._every = int(self.every_n_steps or 10) if self._cuda is not None else 1
        self.matmul_dtype = matmul_dtype(trainer)
        self.peak_flops_per_rank = peak_flops_per_device(pl_module.device, self.matmul_dtype, self.peak_tflops)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the loaders exist from here on: a plain DataLoader's batch size is known
        self.global_batch_size = global_batch_of(trainer) or 0
        self.flops_per_step, self.flops_note = None, None
        if self.global_batch_size:
            self.flops_per_step, self.flops_note = count_model_flops(pl_module, self.global_batch_size)
        else:
            self.flops_note = "FLOPs not counted: the global batch size is unknown"
        if self.flops_note:
            log.info("%s; MFU will be null", self.flops_note)

    def _now(self) -> float:
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)  # once per window
        return time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        if self._open is None:
            self._open = (self._now(), trainer.global_step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._step_seen:  # still accumulating
            return
        self._step_seen = trainer.global_step
        if self._open is not None and trainer.global_step - self._open[1] >= self._every:
            self._close(pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._open is not None and self._step_seen > self._open[1]:
            self._close(pl_module, log=False)  # the last, shorter window (Lightning allows no logging here)

    def _close(self, pl_module: L.LightningModule, log: bool = True) -> None:
        assert self._open is not None
        started, step0 = self._open
        now = self._now()
        steps = self._step_seen - step0
        dt = (now - started) / steps
        self.windows.append((step0 + 1, steps, dt))
        self._open = (now, self._step_seen)
        metrics = {"perf/step_time_s": dt}
        if self.global_batch_size:
            metrics["perf/samples_per_s"] = self.global_batch_size / dt
        if self.flops_per_step and self.peak_flops_per_rank:
            metrics["perf/mfu"] = self.flops_per_step / dt / (self.peak_flops_per_rank * self.world_size)
        if log and logs_this_step(pl_module.trainer):  # the loggers write on_step values on these steps only
            pl_module.log_dict(metrics, rank_zero_only=True)

    def summary(self) -> dict[str, Any]:
        measured = [dt for first, n, dt in self.windows if first - self._start_step > self.warmup_steps
                    for _ in range(n)] or self.step_times
        note = {"mfu_note": self.flops_note} if self.flops_note else {}  # present only when that is why MFU is null
        if not measured:
            return {"step_time_s": None, "samples_per_s": None, "tokens_per_s": None, "mfu": None, **note}
        step = statistics.median(measured)
        samples = self.global_batch_size / step if self.global_batch_size else None
        tokens = samples * self.tokens_per_sample if samples and self.tokens_per_sample else None
        mfu = None
        if self.flops_per_step and self.peak_flops_per_rank:
            mfu = self.flops_per_step / step / (self.peak_flops_per_rank * self.world_size)
        return {"step_time_s": step, "samples_per_s": samples, "tokens_per_s": tokens, "mfu": mfu,
                "flops_per_step": self.flops_per_step,
                "matmul_dtype": str(self.matmul_dtype).removeprefix("torch.") if self.matmul_dtype else None, **note}
