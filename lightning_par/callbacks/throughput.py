"""Throughput and MFU.

Step time is the wall time between consecutive optimizer-step ends (so it includes data loading,
forward, backward, communication and the optimizer). FLOPs per optimizer step come from torch's
FLOP counter (through Lightning's ``measure_flops``) run once on a meta-device copy of the model's
architecture -- forward and backward for the whole global batch, no real compute; a Hugging Face MoE
copy counts the routed work, each token through its top-k experts (``parallel/hf/flops.py``). A model
that cannot be counted so (an op the meta device cannot run) is not an error: its MFU is null and the
summary's ``mfu_note`` says why in one line.

A model without that protocol (``build_net(device)`` and ``example_input(batch_size, device)``: any
LightningModule of the user's own, a Hugging Face model held in one) is measured instead: the run's
second optimizer step (the first carries one-off work, such as a pipeline's shape inference; past the
steps a ``CommMonitor`` records) runs under torch's ``FlopCounterMode`` -- its dispatch mode and
formulas, without its per-module tracking, whose backward hooks break a pipeline stage's
``autograd.grad`` -- on every rank, each counting its part (forward, backward, optimizer), and the
ranks' counts are summed, then divided by the tensor-parallel degree, whose ranks see their sharded
matmuls at the full DTensor shapes. That step lies in the warm-up the step-time median leaves out; ops
the counter has no formula for count nothing (as on the meta copy), activation-checkpoint recomputation
counts as work done, and a model routing tokens through transformers' experts (grouped matmuls: no
formula) is left uncounted with a note rather than under-counted.

MFU divides the achieved model FLOP/s by the dense device peak for the dtype the matmuls run in
(``matmul_dtype``: FSDP's ``param_dtype`` when the strategy sets one, else the trainer's precision;
peaks from ``lightning_par/core/devices.py``, or ``peak_tflops`` to override) times the number of ranks;
where the peak is unknown (CPU), MFU is null.

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
import math
import statistics
import time
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import measure_flops

from lightning_par.core import dtypes
from lightning_par.core.devices import peak_flops_per_device
from lightning_par.core.logging_steps import logs_this_step

log = logging.getLogger(__name__)


def precision_dtype(precision: str | int) -> torch.dtype:
    """The dtype matmuls run in under a Lightning precision (``lightning_par/core/dtypes.py``); fp32 for
    one the table lacks (e.g. bitsandbytes' ``nf4``)."""
    try:
        return dtypes.precision(precision).compute
    except ValueError:
        return torch.float32


def matmul_dtype(trainer: L.Trainer) -> torch.dtype:
    """The dtype the model's matmuls run in: FSDP mixed precision's ``param_dtype`` if the strategy
    has one (any spelling of ``lightning_par/core/dtypes.py``: bf16, bfloat16, torch.bfloat16 ...), else
    what the trainer's precision computes in (bf16-mixed: bf16, 32-true: fp32)."""
    param_dtype = getattr(trainer.strategy, "param_dtype", None)
    if param_dtype:
        try:
            return dtypes.to_dtype(param_dtype, "param_dtype")
        except ValueError:  # not ours to refuse here (the strategy checks its own options)
            pass
    return precision_dtype(trainer.precision)


def class_name(obj: object) -> str:
    """The name of the class the user wrote: FSDP2's ``fully_shard`` swaps a module's class for a dynamic
    ``FSDP<Name>`` subclass, which messages must not show."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed
        return type(obj).__name__
    return next((c.__name__ for c in type(obj).__mro__ if not issubclass(c, FSDPModule)), type(obj).__name__)


def count_model_flops(pl_module: L.LightningModule, batch_size: int) -> tuple[int | None, str | None]:
    """Training FLOPs (forward + backward) of one batch, counted on a meta copy: ``(flops, None)``, or
    ``(None, why not)`` in one line. Never raises: a model the meta device cannot run only loses its MFU.

    A Hugging Face MoE copy runs its experts with ``batched_mm`` first (``parallel/hf/flops.py``), so
    the count is the routed work (each token through its top-k experts); one whose experts cannot be
    counted so is refused rather than counted as all experts on every token."""
    flops, note, _ = _meta_count(pl_module, batch_size)
    return flops, note


def _meta_count(pl_module: L.LightningModule, batch_size: int) -> tuple[int | None, str | None, bool]:
    """``count_model_flops``, and whether the model has no meta copy at all (no ``build_net`` /
    ``example_input``, or ``ParModule``'s defaults, which raise ``NotImplementedError``): such a model is
    measured on a real step instead (``FlopsOfAStep``)."""
    from lightning_par.parallel.hf.flops import FlopsUnknown, route_experts_for_counting

    build = getattr(pl_module, "build_net", None)
    example = getattr(pl_module, "example_input", None)
    name = class_name(pl_module)
    if not callable(build) or not callable(example):
        return None, f"FLOPs not counted: {name} has no build_net(device) and example_input(batch_size, device)", True
    try:
        net = build("meta")
        x = example(batch_size, "meta")
    except NotImplementedError as e:  # ParModule's defaults: the model builds no meta copy
        return None, f"FLOPs not counted: {name} builds no meta copy ({_one_line(e)})", True
    except Exception as e:  # noqa: BLE001 - a measurement: whatever fails, the run goes on without it
        return None, f"FLOPs not counted: building {name}'s meta copy failed ({_one_line(e)})", False
    try:
        route_experts_for_counting(net)
        return int(measure_flops(net, lambda: net(x), lambda y: y.float().sum())), None, False
    except FlopsUnknown as e:
        return None, f"FLOPs not counted: {e}", False
    except Exception as e:  # noqa: BLE001 - e.g. an op without a meta kernel, or a data-dependent one (nonzero)
        return None, f"FLOPs not counted: running {name} on the meta device failed ({_one_line(e)})", False


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


class _NoModuleTracking:
    """Stands in for ``FlopCounterMode``'s ``ModuleTracker``: every count goes to ``Global`` only. The tracker's
    backward hooks break a step that runs ``torch.autograd.grad`` (a pipeline stage's backward: "A leaf node
    was passed to _will_engine_execute_node but we are currently running autograd.grad()"), and a
    measurement must never stop the run; the per-module table is not needed here."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _NoModuleTracking:
        return self

    def __exit__(self, *args: Any) -> None:
        return None


def _step_counter() -> Any:
    """torch's ``FlopCounterMode`` (its dispatch mode and formulas), without module tracking, not counting
    ops on the meta device, and with a formula that fails on an op's arguments recorded rather than raised
    into the training step."""
    from torch.utils.flop_counter import FlopCounterMode

    class StepFlopCounter(FlopCounterMode):
        def __init__(self) -> None:
            super().__init__(display=False)
            self.mod_tracker = _NoModuleTracking()
            self.failed: str | None = None

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            if isinstance(out, torch.Tensor) and out.is_meta:  # shapes only (a pipeline's first-step shape
                return out                                       # inference): no work done
            try:
                return super()._count_flops(func_packet, out, args, kwargs)
            except Exception as e:  # noqa: BLE001 - the step goes on; the count is then unknown
                self.failed = self.failed or f"{func_packet}: {_one_line(e)}"
                return out

    return StepFlopCounter()


class FlopsOfAStep:
    """Torch's ``FlopCounterMode`` over one optimizer step of the live model, on every rank: entered at the
    step's first micro-batch, left when the step has ended; ``total`` sums the ranks' counts (a collective)."""

    def __init__(self) -> None:
        self.mode = _step_counter()
        self.active = False

    def start(self) -> None:
        self.mode.__enter__()
        self.active = True

    def stop(self) -> int | None:
        """This rank's count (the mode left); None when a formula failed."""
        if not self.active:
            return 0
        self.active = False
        self.mode.__exit__(None, None, None)
        return None if self.mode.failed else int(self.mode.get_total_flops())

    @staticmethod
    def total(trainer: L.Trainer, local: int | None) -> int | None:
        """The step's FLOPs over all ranks: the sum of ``local``, over the tensor-parallel degree; None when
        a rank's count failed."""
        import torch.distributed as dist

        total = float(local) if local is not None else float("nan")
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            t = torch.tensor([total], dtype=torch.float64, device=trainer.strategy.root_device)
            dist.all_reduce(t)
            total = float(t.item())
        if not math.isfinite(total):  # NaN: some rank's count failed
            return None
        tp = int((getattr(trainer.strategy, "mesh_sizes", None) or {}).get("tp", 1) or 1)
        return int(round(total / tp))


def counted_step(trainer: L.Trainer, start: int) -> int:
    """The step whose FLOPs are measured, as the global step at its start: the second of the fit (the first
    carries one-off work: a pipeline's shape inference runs a real forward of a micro-batch), moved past the
    steps a ``CommMonitor`` records (two dispatch modes over one step would not nest)."""
    step = start + 1
    for cb in getattr(trainer, "callbacks", None) or []:
        if type(cb).__name__ == "CommMonitor":
            first = max(start, int(cb.warmup_steps))
            if first <= step < first + int(cb.measure_steps):
                step = first + int(cb.measure_steps)
    return step


def holds_routed_experts(pl_module: L.LightningModule) -> str | None:
    """A one-line reason when the model runs tokens through transformers' experts implementations (grouped
    matmuls, which torch's FLOP counter has no formula for: a measured step would under-count them)."""
    from lightning_par.parallel.hf.flops import dispatches_experts

    for path, module in pl_module.named_modules():
        if dispatches_experts(module):
            return (f"FLOPs not counted: {class_name(pl_module)} routes tokens through transformers' experts "
                    f"({type(module).__name__} at {path}), whose grouped matmuls torch's FLOP counter cannot count")
    return None


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
        #: how flops_per_step was found: "meta copy" or "measured step" (None: not yet, or not at all)
        self.flops_method: str | None = None
        self._measure: FlopsOfAStep | None = None  # the step being counted (measured models)
        self._measure_pending = False
        self._measure_step = 1  # the global step (steps done) at whose start the count begins
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
        self.flops_per_step, self.flops_note, self.flops_method = None, None, None
        self._measure, self._measure_pending = None, False
        flops, note, measure = _meta_count(pl_module, max(self.global_batch_size, 1))
        if measure:  # no meta copy: count a step as it runs (needs no batch size)
            self.flops_note = holds_routed_experts(pl_module)
            self._measure_pending = self.flops_note is None
            self._measure_step = counted_step(trainer, trainer.global_step)
        elif self.global_batch_size:
            self.flops_per_step, self.flops_note = flops, note
            self.flops_method = "meta copy" if flops else None
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
        if self._measure_pending and self._measure is None and trainer.global_step == self._measure_step:
            # the first micro-batch of the counted step
            self._measure = FlopsOfAStep()
            self._measure.start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._step_seen:  # still accumulating
            return
        self._step_seen = trainer.global_step
        if self._measure is not None and self._measure.active:  # the counted step has ended
            local = self._measure.stop()
            failed = self._measure.mode.failed
            self._measure_pending = False
            total = FlopsOfAStep.total(trainer, local)  # a collective: every rank is here
            self.flops_per_step = total or None
            self.flops_method = "measured step" if total else None
            if not total:
                why = (f"a formula failed ({failed})" if failed else "another rank's count failed" if total is None
                       else "it saw no matmul or convolution")
                self.flops_note = (f"FLOPs not counted: torch's FLOP counter on {class_name(pl_module)}'s step "
                                   f"{self._measure_step + 1}: {why}")
        if self._open is not None and trainer.global_step - self._open[1] >= self._every:
            self._close(pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._measure is not None:
            self._measure.stop()  # never leave the counter installed

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._measure is not None:
            self._measure.stop()  # a run that ended inside its counted step
        if self._measure_pending:
            self._measure_pending = False
            self.flops_note = (f"FLOPs not counted: the run ended before step {self._measure_step + 1}, the one "
                               f"torch's FLOP counter measures {class_name(pl_module)} on")
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
                "flops_per_step": self.flops_per_step, "flops_method": self.flops_method,
                "matmul_dtype": str(self.matmul_dtype).removeprefix("torch.") if self.matmul_dtype else None, **note}
