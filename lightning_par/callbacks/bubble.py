"""Pipeline bubble: measured idle time of every pipeline rank next to the theory, a timeline picture
and a Chrome/Perfetto trace.

The pipeline's ``StageTimer`` (layer 1) records the compute of every stage -- forward (F),
backward (B, or I + W for zero-bubble schedules) and the loss (L) per micro-batch -- and the wall
time of each schedule call. A step's wall time is that of the pipeline, the longest of its
ranks' schedule calls (they start together: the previous step ends with an all-reduce of the loss
over the pipeline; the first rank is the last to finish, the last rank finishes early and then
waits for the next step, which is idle time too). For the measured steps (after ``warmup_steps``:
the first one infers shapes and warms allocators) a rank's bubble is ``1 - sum(busy) /
sum(step wall)``: the fraction of the time it spent idle, including waiting for activations or
gradients to arrive (communication a schedule does not overlap is part of what a bubble costs);
the run's ``measured`` bubble is the mean over the ranks of one pipeline (one replica of the
tp / dp axes). The theory is ``(p-1)/(m+p-1)`` for GPipe and 1F1B
(see ``parallel/pipeline.py`` for the others) -- it assumes equal stage times and free
communication, so a cut that is unbalanced in compute shows up as measured > theory.

Summary key ``bubble``: ``measured``, ``theory``, ``per_stage`` (one entry per pipeline rank:
its stages, busy and wall seconds per step, idle fraction, busy seconds per stage and the peak
bytes of activations saved for backward on each of its stages), ``schedule``, ``n_microbatches``,
``pp``, ``virtual_stages``, ``measured_steps`` and the files written to the run directory:
``pipeline_timeline.png`` (one measured step, one row per rank; matplotlib, skipped with a note
when it is not installed) and ``pipeline_trace.json`` (the last ``trace_steps`` measured steps as
Chrome trace events: open in https://ui.perfetto.dev or chrome://tracing; pid = rank, tid = stage).

Activation memory (``ActivationMeter``): saved-tensors hooks installed around each stage's forward
count the bytes autograd keeps for backward (each storage once, parameters excluded) and release
them when autograd drops them. It measures exactly the activation memory a schedule keeps alive --
GPipe holds all m micro-batches' activations after its forward phase, 1F1B at most p on the first
stage -- on any device, independent of allocator caching and of other processes (CPU RSS is not).
"""

from __future__ import annotations

import json
import os
import time
import weakref
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_par.callbacks.memory import all_gather_objects
from lightning_par.parallel.pipeline import theoretical_bubble

KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)", "L": "loss"}
# after the GPipe paper's timeline figure: forward and backward blocks in two hues, numbered by
# micro-batch, the bubble left empty (grey)
COLORS = {"F": "#9fc5e8", "B": "#f9cb9c", "I": "#f6b26b", "W": "#b6d7a8", "L": "#b4a7d6"}
IDLE_COLOR = "#eeeeee"
TIMELINE_FILE = "pipeline_timeline.png"
TRACE_FILE = "pipeline_trace.json"
SWEEP_FIGURE = "bubble_vs_microbatches.png"


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
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}
        self._params: set[int] = set()
        self._handles: list[Any] = []

    def attach(self, module: nn.Module) -> ActivationMeter:
        self._params |= {_local(p).untyped_storage().data_ptr() for p in module.parameters()}
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

    def reset_peak(self) -> None:
        self.peak = self.live

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
        ref = self._refs.get(key)
        if ref is None:
            self._refs[key] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            ref[0] += 1
        box = _Saved(t)
        weakref.finalize(box, self._release, key)
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
            self.live -= ref[1]


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
        self._busy: list[float] = []  # per measured step
        self._wall: list[float] = []
        self._busy_by_stage: dict[int, float] = {}
        self._steps: list[dict[str, Any]] = []
        self._meters: dict[int, ActivationMeter] = {}
        self._offset = time.time() - time.perf_counter()  # perf_counter -> wall clock, comparable across ranks
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
        timer = pipe.timer
        wall = timer.step_end - timer.step_start
        busy = 0.0
        for e in timer.events:
            busy += e.end - e.start
            self._busy_by_stage[e.stage] = self._busy_by_stage.get(e.stage, 0.0) + (e.end - e.start)
        self._busy.append(busy)
        self._wall.append(wall)
        off = self._offset
        self._steps.append({"step": self._seen - 1, "start": timer.step_start + off, "end": timer.step_end + off,
                            "events": [(e.stage, e.kind, e.microbatch, e.start + off, e.end + off)
                                       for e in timer.events]})
        del self._steps[:-max(1, self.trace_steps)]
        pl_module.log("pipeline/bubble_rank0", max(0.0, 1.0 - busy / max(wall, 1e-12)), rank_zero_only=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pipe = self._pipeline(trainer)
        if pipe is None:
            return
        info = trainer.strategy.pipeline_description()
        n = max(0, self._seen - self.warmup_steps)
        mine = {"rank": trainer.global_rank, "pp_rank": info["pp_rank"], "replica": info["replica"],
                "stages": info["stages"], "n": n, "busy": self._busy, "wall": self._wall,
                "busy_by_stage": dict(self._busy_by_stage), "steps": self._steps,
                "activations": {s: m.peak for s, m in self._meters.items()}}
        for meter in self._meters.values():
            meter.detach()
        ranks = sorted(all_gather_objects(mine), key=lambda r: (r["replica"], r["pp_rank"], r["rank"]))
        self._summary = bubble_summary(ranks, info)
        if trainer.is_global_zero:
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
# Pictures and traces


def write_trace(ranks: Sequence[dict[str, Any]], path: str, info: dict[str, Any]) -> None:
    """Chrome trace events (``ph: "X"``, microseconds) of the kept steps: pid = rank, tid = stage."""
    starts = [s["start"] for r in ranks for s in r["steps"]]
    if not starts:
        return
    t0 = min(starts)
    events: list[dict[str, Any]] = []
    for r in ranks:
        events.append({"name": "process_name", "ph": "M", "pid": r["rank"],
                       "args": {"name": f"rank {r['rank']} (pp {r['pp_rank']}, replica {r['replica']})"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r["rank"],
                       "args": {"sort_index": r["replica"] * 1000 + r["pp_rank"]}})
        for s in r["stages"]:
            events.append({"name": "thread_name", "ph": "M", "pid": r["rank"], "tid": s,
                           "args": {"name": f"stage {s}"}})
        for step in r["steps"]:
            for stage, kind, mb, start, end in step["events"]:
                events.append({"name": f"{kind}{mb}" if mb >= 0 else kind, "cat": KIND_NAMES.get(kind, kind), "ph": "X",
                               "ts": (start - t0) * 1e6, "dur": (end - start) * 1e6, "pid": r["rank"], "tid": stage,
                               "args": {"microbatch": mb, "step": step["step"], "stage": stage}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {k: info[k] for k in ("schedule", "pp", "n_microbatches", "virtual_stages")}}, f)


def draw_timeline(ranks: Sequence[dict[str, Any]], path: str, info: dict[str, Any], summary: dict[str, Any]) -> bool:
    """One measured step (the last), one row per rank: compute blocks coloured by kind and numbered by
    micro-batch, the idle time between them grey. Returns False (with a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print("note: matplotlib is not installed; pipeline timeline PNG skipped (pip install matplotlib)")
        return False
    rows = [(r, r["steps"][-1]) for r in ranks if r["steps"]]
    if not rows:
        return False
    t0 = min(step["start"] for _, step in rows)
    t1 = max(step["end"] for _, step in rows)
    scale = 1e3  # ms
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(rows) + 1.6))
    kinds: set[str] = set()
    for i, (r, step) in enumerate(rows):
        y = len(rows) - 1 - i
        ax.broken_barh([((step["start"] - t0) * scale, (step["end"] - step["start"]) * scale)], (y - 0.4, 0.8),
                       facecolors=IDLE_COLOR)
        multi = len(r["stages"]) > 1
        for stage, kind, mb, start, end in step["events"]:
            kinds.add(kind)
            x, w = (start - t0) * scale, (end - start) * scale
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=COLORS.get(kind, "#cccccc"), edgecolor="#555555",
                           linewidth=0.4)
            label = ("L" if mb < 0 else f"{mb}") if not multi else (f"s{stage}" if mb < 0 else f"{mb}/s{stage}")
            if w > (t1 - t0) * scale / 60:
                ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r['rank']}: stage{'s' if len(r['stages']) > 1 else ''} "
                        f"{','.join(map(str, r['stages']))}" for r, _ in reversed(rows)], fontsize=8)
    ax.set_xlim(0, (t1 - t0) * scale)
    ax.set_xlabel("time in the step (ms)")
    measured = summary.get("measured")
    ax.set_title(f"{info['schedule']}: pp={info['pp']}, m={info['n_microbatches']} micro-batches"
                 f"{', v=' + str(info['virtual_stages']) if info['virtual_stages'] > 1 else ''} -- bubble measured "
                 f"{measured:.2f} (mean of the run), theory {summary['theory']:.2f}" if measured is not None else
                 f"{info['schedule']}: pp={info['pp']}", fontsize=9)
    handles = [Patch(facecolor=COLORS[k], edgecolor="#555555", label=KIND_NAMES[k]) for k in "FBIWL" if k in kinds]
    handles.append(Patch(facecolor=IDLE_COLOR, label="idle (bubble)"))
    legend_h = 0.35 / fig.get_figheight()  # a fixed strip at the bottom for the legend
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, legend_h, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------
# Sweeps


def _sweep_rows(sweep_dir: str) -> list[dict[str, Any]]:
    rows = []
    for root, _, files in os.walk(sweep_dir):
        if "summary.json" not in files:
            continue
        with open(os.path.join(root, "summary.json")) as f:
            s = json.load(f)
        b = s.get("bubble")
        if b:
            rows.append({"job": os.path.relpath(root, sweep_dir), "schedule": b["schedule"], "pp": b["pp"],
                         "virtual_stages": b.get("virtual_stages", 1), "n_microbatches": b["n_microbatches"],
                         "measured": b["measured"], "theory": b["theory"], "step_time_s": s.get("step_time_s")})
    return sorted(rows, key=lambda r: (r["schedule"], r["pp"], r["virtual_stages"], r["n_microbatches"]))


def plot_bubble_sweep(sweep_dir: str) -> str | None:
    """Measured and theoretical bubble against the number of micro-batches, one line per schedule,
    from every ``summary.json`` under ``sweep_dir``; writes ``bubble_sweep.json`` and the PNG."""
    rows = _sweep_rows(sweep_dir)
    if not rows:
        return None
    with open(os.path.join(sweep_dir, "bubble_sweep.json"), "w") as f:
        json.dump(rows, f, indent=2)
    print(f"{'schedule':>16} {'pp':>3} {'v':>2} {'m':>4} {'measured':>9} {'theory':>7} {'step ms':>8}")
    for r in rows:
        step = f"{1000 * r['step_time_s']:.0f}" if r["step_time_s"] else "-"
        meas = f"{r['measured']:.3f}" if r["measured"] is not None else "-"
        print(f"{r['schedule']:>16} {r['pp']:>3} {r['virtual_stages']:>2} {r['n_microbatches']:>4} {meas:>9} "
              f"{r['theory']:>7.3f} {step:>8}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; bubble sweep figure skipped (pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["schedule"], r["pp"], r["virtual_stages"]), []).append(r)
    for (schedule, pp, v), rs in groups.items():
        ms = [r["n_microbatches"] for r in rs]
        label = f"{schedule} pp={pp}" + (f" v={v}" if v > 1 else "")
        line, = ax.plot(ms, [r["measured"] for r in rs], "o-", label=f"{label} measured")
        ax.plot(ms, [r["theory"] for r in rs], "--", color=line.get_color(), alpha=0.7, label=f"{label} theory")
    ax.set_xscale("log", base=2)
    ticks = sorted({r["n_microbatches"] for r in rows})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("micro-batches per batch (m)")
    ax.set_ylabel("bubble (idle fraction of the step)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(sweep_dir, SWEEP_FIGURE)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    print(f"bubble sweep figure: {path}")
    return path


try:  # Hydra is a dependency of run.py; the callback class only needs it at sweep time
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover
    _HydraCallback = object  # type: ignore[assignment,misc]


class BubbleSweepFigure(_HydraCallback):  # type: ignore[misc,valid-type]
    """Hydra callback: after a multirun, plot every job's bubble against its number of micro-batches
    (``bubble_vs_microbatches.png`` and ``bubble_sweep.json`` in the sweep directory)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        plot_bubble_sweep(str(config.hydra.sweep.dir))
