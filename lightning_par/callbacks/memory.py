"""Memory per rank, by category.

Model states are counted from the tensors each rank actually holds (local shards only, each
storage once), at the moment they are all alive: just before the optimizer step, when parameters,
gradients and optimizer state coexist. The accelerator allocator's peak (CUDA) and the process's
peak resident set size complete the picture. Figures are per rank, gathered to every rank.
"""

from __future__ import annotations

import gc
import resource
import sys
from collections.abc import Iterable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist


def unique_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> tuple[int, int]:
    """(all bytes, host bytes) of tensors, counting each storage once across calls sharing ``seen``."""
    total = host = 0
    for t in stored_tensors(tensors):
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        nbytes = storage.nbytes()
        total += nbytes
        host += nbytes if t.device.type == "cpu" else 0
    return total, host


def stored_tensors(tensors: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
    """The tensors that own storage: a wrapper subclass (torchao's 8-bit optimizer state: uint8 codes
    plus fp32 block scales; a DTensor's local shard) has none itself, so its inner tensors are
    counted instead, through the subclass protocol ``__tensor_flatten__``."""
    for t in tensors:
        flatten = getattr(t, "__tensor_flatten__", None) if t is not None else None
        if callable(flatten):
            yield from stored_tensors(getattr(t, name) for name in flatten()[0])
        else:
            yield t


def _proc_status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` memory field (``VmHWM``, ``VmRSS``) in bytes; None where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size: on Linux ``VmHWM``, since the process started or since
    ``reset_peak_rss``; elsewhere ``getrusage``'s, since the process started."""
    peak = _proc_status_bytes("VmHWM")
    if peak is not None:
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def current_rss_bytes() -> int | None:
    """This process's resident set size now (``VmRSS``); None where /proc is absent."""
    return _proc_status_bytes("VmRSS")


def reset_peak_rss() -> bool:
    """Start the peak RSS over from the current RSS (Linux: ``clear_refs``). A Hydra multirun trains
    its jobs one after another in one process, rank 0 included: without this, every job's peak would
    be the largest of the jobs before it. ``getrusage``'s ``ru_maxrss`` cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def all_gather_objects(obj: Any) -> list[Any]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def measure_model_states(strategy: Any, module: torch.nn.Module, optimizers: list) -> dict[str, int]:
    """Bytes of params / grads / optimizer state on this rank, and how many of them sit in host memory
    because the strategy keeps them there (its ``cpu_offload``)."""
    getter = getattr(strategy, "model_state_tensors", None)
    if callable(getter):
        groups = getter()
    else:  # a plain Lightning strategy: count what the module and optimizers hold
        groups = {
            "params": module.parameters(),
            "grads": (p.grad for p in module.parameters() if p.grad is not None),
            "optimizer_state": (v for o in optimizers for s in o.state.values() for v in s.values()
                                if isinstance(v, torch.Tensor)),
        }
    seen: set[int] = set()
    out, offloaded = {}, 0
    for category in ("params", "grads", "optimizer_state"):
        total, host = unique_bytes(groups[category], seen)
        out[category] = total
        offloaded += host
    out["offloaded"] = offloaded if getattr(strategy, "cpu_offload", False) else 0
    return out


class MemoryMonitor(L.Callback):
    """Records model-state bytes per rank before the first measured optimizer step, plus peaks at the end.

    Args:
        measure_at_step: optimizer step (0-based) whose pre-step state is measured; after the first,
            so lazily created optimizer state exists.
    """

    def __init__(self, measure_at_step: int = 1) -> None:
        self.measure_at_step = measure_at_step
        self._states: dict[str, int] | None = None
        self._at_step = False  # ``_states`` is ``measure_at_step``'s (not an earlier step's)
        self._setup: dict[str, int | None] = {}
        self._rss_before: int | None = None
        self._peak_allocated: int | None = None
        self.per_rank: list[dict[str, Any]] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # before the model is built: this fit's peaks, not an earlier job's in the same process (whose
        # model and optimizer may still sit in reference cycles until a collection frees them)
        gc.collect()
        reset_peak_rss()
        self._rss_before = current_rss_bytes()  # what the process holds before any of the model: imports

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the strategy's setup (build, shard, materialise) is over and no step has run: what a rank
        # needs just to hold its part of the model
        self._states, self._at_step = None, False
        self._peak_allocated = None
        self.per_rank = []
        self._setup = {"setup_peak_rss": peak_rss_bytes(), "setup_peak_allocated": None}
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            self._setup["setup_peak_allocated"] = int(torch.cuda.max_memory_allocated(pl_module.device))
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        # every step before ``measure_at_step`` is measured too, and replaced: a run too short to reach it
        # keeps its last step's (the gradients are freed right after each step, so after training there are none)
        if self._states is None or not self._at_step:
            self._states = measure_model_states(trainer.strategy, pl_module, trainer.optimizers)
            self._at_step = trainer.global_step >= self.measure_at_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # before teardown: Lightning's teardown moves single-device and DDP modules back to the CPU,
        # after which ``pl_module.device`` no longer names the GPU (on_fit_end runs after teardown).
        # The allocator's counters are host-side: reading them syncs nothing, and it happens once.
        self._peak_allocated = None
        device = trainer.strategy.root_device
        if device.type == "cuda":
            self._peak_allocated = int(torch.cuda.max_memory_allocated(device))
        if self._states is None:  # no optimizer step at all: measure what is held now (still on the device)
            self._states = measure_model_states(trainer.strategy, pl_module, trainer.optimizers)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.finalize(trainer, pl_module)

    def finalize(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Gather every rank's figures (a collective), once per fit: from ``on_fit_end``, or earlier
        from ``RunSummary`` when it comes first in a user's callback list."""
        if self.per_rank:
            return
        if self._states is None:  # training never ran its end hook (e.g. no step): measure what is held now
            self._states = measure_model_states(trainer.strategy, pl_module, trainer.optimizers)
        mine = {"rank": trainer.global_rank, **self._states, "peak_allocated": self._peak_allocated,
                "peak_rss": peak_rss_bytes(), **self._setup, "rss_before_setup": self._rss_before}
        self.per_rank = sorted(all_gather_objects(mine), key=lambda r: r["rank"])

    def summary(self) -> dict[str, Any]:
        return {"memory": self.per_rank}
