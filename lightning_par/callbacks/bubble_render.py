"""Pipeline bubble, rendered: the Chrome/Perfetto trace and the timeline picture of one run, and the
figure and table of a sweep. Everything here draws what ``callbacks/bubble.py`` measured (its
gathered per-rank records and the summary's ``bubble``) and computes nothing new.

- ``write_trace``: the kept steps as Chrome trace events (``ph: "X"``, microseconds; pid = rank,
  tid = stage): open in https://ui.perfetto.dev or chrome://tracing.
- ``draw_timeline``: one measured step, one row per rank, after the GPipe paper's timeline figure
  (matplotlib; skipped with a note when it is not installed).
- ``plot_bubble_sweep`` / ``BubbleSweepFigure``: after a multirun, every job's measured and
  theoretical bubble against its number of micro-batches (``bubble_sweep.json``, a table on stdout
  and ``bubble_vs_microbatches.png``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)", "L": "loss"}
# after the GPipe paper's timeline figure: forward and backward blocks in two hues, numbered by
# micro-batch, the bubble left empty (grey)
COLORS = {"F": "#9fc5e8", "B": "#f9cb9c", "I": "#f6b26b", "W": "#b6d7a8", "L": "#b4a7d6"}
IDLE_COLOR = "#eeeeee"
SWEEP_FIGURE = "bubble_vs_microbatches.png"


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
