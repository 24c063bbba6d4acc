"""Pipeline bubble, measured: the idle time of every pipeline rank next to the theory, and the
activation memory each stage keeps for backward. The numbers only; the trace, the timeline picture
and the sweep figure are drawn from them in ``callbacks/bubble_render.py``.

The pipeline's ``StageTimer`` (layer 1) records the compute of every stage -- forward (F),
backward (B, or I + W for zero-bubble schedules) and the loss (L) per micro-batch -- and the wall
time of each schedule call, all read off one clock (``time.perf_counter`` in a run; a test injects
a deterministic one through ``build_schedule(clock=...)``). ``BubbleMeter`` turns each measured
schedule call into busy and wall seconds (``parallel.pipeline.bubble_stats``) and keeps the events
of the last few for the trace. A step's wall time is that of the pipeline, the longest of its
ranks' schedule calls (they start together: the previous step ends with an all-reduce of the loss
over the pipeline; the first rank is the last to finish, the last rank finishes early and then
waits for the next step, which is idle time too). For the measured steps (after ``warmup_steps``:
the first one infers shapes and warms allocators) a rank's bubble is ``1 - sum(busy) /
sum(step wall)``: the fraction of the time it spent idle, including waiting for activations or
gradients to arrive (communication a schedule does not overlap is part of what a bubble costs);
the run's ``measured`` bubble is the mean over the ranks of one pipeline (one replica of the
tp / dp axes), ``bubble_summary``. The theory is ``(p-1)/(m+p-1)`` for GPipe and 1F1B
(see ``parallel/pipeline/schedule.py`` for the others) -- it assumes equal stage times and free
communication, so a cut that is unbalanced in compute shows up as measured > theory.

Summary key ``bubble``: ``measured``, ``theory``, ``per_stage`` (one entry per pipeline rank:
its stages, busy and wall seconds per step, idle fraction, busy seconds per stage and the peak
bytes of activations saved for backward on each of its stages), ``schedule``, ``n_microbatches``,
``pp``, ``virtual_stages``, ``measured_steps`` and the files ``BubbleMonitor`` has drawn into the
run directory: ``pipeline_timeline.png`` (one measured step, one row per rank; matplotlib, skipped
with a note when it is not installed) and ``pipeline_trace.json`` (the last ``trace_steps``
measured steps as Chrome trace events: open in https://ui.perfetto.dev or chrome://tracing; pid =
rank, tid = stage).

Activation memory (``ActivationMeter``): saved-tensors hooks installed around each stage's forward
count the bytes autograd keeps for backward (each storage once, parameters excluded) and release
them when autograd drops them. It measures exactly the activation memory a schedule keeps alive --
GPipe holds all m micro-batches' activations after its forward phase, 1F1B at most p on the first
stage -- on any device, independent of allocator caching and of other processes (CPU RSS is not).
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_par.callbacks.bubble_render import draw_timeline, write_trace
from lightning_par.callbacks.memory import all_gather_objects
from lightning_par.parallel.pipeline.schedule import StageTimer, bubble_stats, theoretical_bubble

TIMELINE_FILE = "pipeline_timeline.png"
TRACE_FILE = "pipeline_trace.json"


# ---------------------------------------------------------------------------------------------
# Activation memory


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class ActivationMeter:
    """Live and peak bytes of the tensors that the attached modules save for backward.

    ``attach(module)`` wraps every forward of ``module`` in ``torch.autograd.graph.saved_tensors_hooks``;
    a saved tensor's storage is counted once while any saved reference to it is alive (parameters
    and views of them excluded) and released when autograd frees it after backward.
    """

    def __init__(self) -> None:
        self._live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}
        # Each saved box is watched by a weak reference whose callback is a C function (``list.append``),
        # not a Python finalizer: Python raises a pending Ctrl-C inside whatever Python code runs next,
        # and inside a finalizer or weakref callback it prints "Exception ignored" and drops it (a
        # pipeline run's Ctrl-C was lost that way). Dead boxes are counted off at the next pack or read.
        self._boxes: dict[int, tuple[weakref.ref, int]] = {}
        self._dead: list[weakref.ref] = []
        self._params: set[int] = set()
        self._handles: list[Any] = []

    def attach(self, module: nn.Module) -> ActivationMeter:
        from lightning_par.callbacks.memory import stored_tensors  # NF4 (QLoRA): the storages inside the subclass

        self._params |= {t.untyped_storage().data_ptr() for t in stored_tensors(_local(p) for p in module.parameters())}
        contexts: list[Any] = []

        def enter(mod: nn.Module, args: Any) -> None:
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
            contexts.append(ctx)

        def leave(mod: nn.Module, args: Any, out: Any) -> None:
            if contexts:
                contexts.pop().__exit__(None, None, None)

        self._handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def live(self) -> int:
        self._drain()
        return self._live

    def reset_peak(self) -> None:
        self.peak = self.live

    def _drain(self) -> None:
        while self._dead:
            ref = self._dead.pop()
            entry = self._boxes.pop(id(ref), None)
            if entry is not None:
                self._release(entry[1])

    def _pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter):
            return t
        local = _local(t)
        if local.device.type == "meta":
            return t
        try:
            storage = local.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # a tensor without a real storage (a wrapper subclass, e.g. a replicated DTensor
            return t          # weight saved by a Hugging Face norm under TP): nothing of its own to count
        if key in self._params or nbytes == 0:
            return t
        self._drain()  # frees only lower the live bytes: counted here, where the peak can rise
        ref = self._refs.get(key)
        if ref is None:
            self._refs[key] = [1, nbytes]
            self._live += nbytes
            self.peak = max(self.peak, self._live)
        else:
            ref[0] += 1
        box = _Saved(t)
        watch = weakref.ref(box, self._dead.append)
        self._boxes[id(watch)] = (watch, key)
        return box

    @staticmethod
    def _unpack(box: Any) -> torch.Tensor:
        return box.tensor if isinstance(box, _Saved) else box

    def _release(self, key: int) -> None:
        ref = self._refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[key]
            self._live -= ref[1]


# ---------------------------------------------------------------------------------------------
# Busy and idle time


class BubbleMeter:
    """One rank's measured schedule calls, from its pipeline's ``StageTimer``: busy and wall seconds
    per call, busy seconds per stage over all calls, and the events of the last ``keep_steps`` calls
    (shifted by ``offset``: the timer's clock -> wall-clock seconds, comparable across ranks).
    """

    def __init__(self, keep_steps: int = 5, offset: float = 0.0) -> None:
        self.keep_steps = max(1, keep_steps)
        self.offset = offset
        self.busy: list[float] = []  # per measured call
        self.wall: list[float] = []
        self.busy_by_stage: dict[int, float] = {}
        self.steps: list[dict[str, Any]] = []

    def add(self, timer: StageTimer, step: int) -> float:
        """Measure the timer's last schedule call (``step``: its number, for the trace); returns this
        rank's idle fraction of it."""
        stats = bubble_stats(timer.events, timer.step_start, timer.step_end)
        wall = timer.step_end - timer.step_start
        for stage, busy in stats["per_stage"].items():
            self.busy_by_stage[stage] = self.busy_by_stage.get(stage, 0.0) + busy
        self.busy.append(stats["busy_s"])
        self.wall.append(wall)
        off = self.offset
        self.steps.append({"step": step, "start": timer.step_start + off, "end": timer.step_end + off,
                           "events": [(e.stage, e.kind, e.microbatch, e.start + off, e.end + off)
                                      for e in timer.events]})
        del self.steps[:-self.keep_steps]
        return stats["bubble"]

    def record(self, *, rank: int, pp_rank: int, replica: int, stages: Sequence[int],
               activations: dict[int, int] | None = None) -> dict[str, Any]:
        """What this rank contributes to ``bubble_summary`` (gathered from every rank)."""
        return {"rank": rank, "pp_rank": pp_rank, "replica": replica, "stages": list(stages), "n": len(self.wall),
                "busy": list(self.busy), "wall": list(self.wall), "busy_by_stage": dict(self.busy_by_stage),
                "steps": list(self.steps), "activations": dict(activations or {})}


def bubble_summary(ranks: Sequence[dict[str, Any]], info: dict[str, Any]) -> dict[str, Any]:
    """The summary's ``bubble`` from every rank's per-step busy and wall seconds (``ranks``: the
    gathered records). A step's wall is the longest of its pipeline's ranks' walls."""
    p, m, v = info["pp"], info["n_microbatches"], info["virtual_stages"]
    pipeline = [r for r in ranks if r["replica"] == 0]
    n = min((len(r["wall"]) for r in pipeline), default=0)
    step_wall = [max(r["wall"][i] for r in pipeline) for i in range(n)]
    total_wall = sum(step_wall)
    per_stage = []
    for r in pipeline:
        busy = sum(r["busy"][:n])
        per_stage.append({
            "pp_rank": r["pp_rank"], "rank": r["rank"], "stages": r["stages"],
            "busy_s": busy / max(1, n), "wall_s": total_wall / max(1, n),
            "bubble": max(0.0, 1.0 - busy / total_wall) if total_wall > 0 else None,
            "busy_s_by_stage": {str(s): t / max(1, n) for s, t in sorted(r["busy_by_stage"].items())},
            "peak_activation_bytes": {str(s): b for s, b in sorted(r["activations"].items())},
        })
    measured = [s["bubble"] for s in per_stage if s["bubble"] is not None]
    return {
        "measured": sum(measured) / len(measured) if measured else None,
        "theory": theoretical_bubble(info["schedule"], p, m, v),
        "per_stage": per_stage,
        "schedule": info["schedule"], "n_microbatches": m, "pp": p, "virtual_stages": v,
        "measured_steps": n,
        "timeline_png": None, "trace_json": None,
    }


# ---------------------------------------------------------------------------------------------
# The callback


class BubbleMonitor(L.Callback):
    """Measured vs. theoretical pipeline bubble, timeline PNG and Perfetto trace (no-op without a pipeline).

    Works with any strategy exposing ``pipeline`` (a layer-1 ``Pipeline``) and
    ``pipeline_description()`` (the strategies in ``strategies/composite.py``).

    Args:
        output_dir: where the PNG and the trace go (the run directory); None: the trainer's root dir.
        warmup_steps: schedule calls left out (the first infers shapes).
        trace_steps: how many of the last measured steps go into the trace.
        timeline / trace: write the PNG / the trace JSON.
        track_activations: count activation bytes per stage (saved-tensors hooks).
    """

    def __init__(self, output_dir: str | None = None, warmup_steps: int = 2, trace_steps: int = 5,
                 timeline: bool = True, trace: bool = True, track_activations: bool = True) -> None:
        self.output_dir = output_dir
        self.warmup_steps = warmup_steps
        self.trace_steps = trace_steps
        self.timeline = timeline
        self.trace = trace
        self.track_activations = track_activations
        self._reset()

    def _reset(self) -> None:
        self._seen = 0
        self._bubble: BubbleMeter | None = None  # made at the first measured step
        self._meters: dict[int, ActivationMeter] = {}
        self._summary: dict[str, Any] | None = None

    @staticmethod
    def _pipeline(trainer: L.Trainer) -> Any:
        return getattr(trainer.strategy, "pipeline", None)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()
        pipe = self._pipeline(trainer)
        if pipe is not None and self.track_activations:
            self._meters = {m.stage_index: ActivationMeter().attach(m) for m in pipe.modules}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pipe = self._pipeline(trainer)
        if pipe is None:
            return
        self._seen += 1
        if self._seen <= self.warmup_steps:
            for meter in self._meters.values():  # shape inference and first allocations are not steady state
                meter.reset_peak()
            return
        if self._bubble is None:  # the timer's clock -> wall clock, comparable across ranks
            self._bubble = BubbleMeter(self.trace_steps, offset=time.time() - pipe.timer.clock())
        bubble = self._bubble.add(pipe.timer, step=self._seen - 1)
        pl_module.log("pipeline/bubble_rank0", bubble, rank_zero_only=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pipe = self._pipeline(trainer)
        if pipe is None:
            return
        info = trainer.strategy.pipeline_description()
        measured = self._bubble or BubbleMeter(self.trace_steps)
        n = len(measured.wall)
        mine = measured.record(rank=trainer.global_rank, pp_rank=info["pp_rank"], replica=info["replica"],
                               stages=info["stages"], activations={s: m.peak for s, m in self._meters.items()})
        for meter in self._meters.values():
            meter.detach()
        ranks = sorted(all_gather_objects(mine), key=lambda r: (r["replica"], r["pp_rank"], r["rank"]))
        self._summary = bubble_summary(ranks, info)
        if trainer.is_global_zero:  # rendered from the numbers: callbacks/bubble_render.py
            out = self.output_dir or trainer.default_root_dir
            os.makedirs(out, exist_ok=True)
            if self.trace and n:
                path = os.path.join(out, TRACE_FILE)
                write_trace(ranks, path, info)
                self._summary["trace_json"] = path
            if self.timeline and n:
                path = os.path.join(out, TIMELINE_FILE)
                if draw_timeline(ranks, path, info, self._summary):
                    self._summary["timeline_png"] = path
            for logger in trainer.loggers:
                logger.log_metrics({"pipeline/bubble_measured": self._summary["measured"] or 0.0,
                                    "pipeline/bubble_theory": self._summary["theory"]}, step=trainer.global_step)

    def summary(self) -> dict[str, Any]:
        return {"bubble": self._summary}
