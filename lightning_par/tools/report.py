"""Turn a sweep into one page: a markdown table of every run and PNG plots.

    lightning-par-report SWEEP_DIR [--out DIR]          (or python -m lightning_par.tools.report)

Reads every ``summary.json`` under SWEEP_DIR (the run summary, see the README) and every ``error.json``
(left by failed jobs, see ``lightning_par/core/jobs.py``) and writes into DIR (default: SWEEP_DIR):

- ``report.md``: one row per run (strategy, world size, mesh, parameters, precision, global batch,
  final loss, step time, samples/s, tokens/s, MFU, model-state bytes per rank), the failed jobs with
  their error, and the plots;
- ``memory.png``: model-state bytes per rank, stacked by category (params / grads / optimizer
  state), one bar group per run and one bar per rank; bytes kept in host memory by offload are a
  part of those and are drawn hatched over the stack;
- ``speed.png``: step time and throughput of every run;
- ``comm.png``: collective payload bytes per optimizer step of every run (summary key ``comm``),
  stacked by kind (all-reduce, all-gather, ...), see docs/communication.md;
- ``loss.png``: the loss curves of all runs overlaid;
- ``bubble.png`` (pipeline runs only): measured bubble fraction against the number of
  micro-batches, with the theory curve (p-1)/(m+p-1) for each pipeline depth p.

A plot without data is skipped, not drawn empty. Summaries are read defensively: missing keys and
nulls show as "-". Failed jobs do not stop the report: it exits 0 whenever it could write report.md
(a plot that cannot be drawn, or matplotlib missing, is named in report.md and on stderr instead).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_par.core import units

from hydra.experimental.callback import Callback

SUMMARY_FILE = "summary.json"
ERROR_FILE = "error.json"
MEMORY_CATEGORIES = ("params", "grads", "optimizer_state")
CATEGORY_LABELS = {"params": "params", "grads": "grads", "optimizer_state": "optimizer state",
                   "offloaded": "offloaded (host)"}


# ---------------------------------------------------------------------------------------------------
# collecting


@dataclass
class Run:
    job: str                      # job directory relative to the sweep dir ("." for the sweep dir itself)
    summary: dict[str, Any]
    overrides: list[str] = field(default_factory=list)
    label: str = ""


@dataclass
class Failure:
    job: str
    error: str
    type: str | None
    overrides: list[str] = field(default_factory=list)


def _natural_key(path: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def _job_name(path: Path, root: Path) -> str:
    rel = path.parent.relative_to(root).as_posix()
    return rel if rel else "."


def _job_overrides(job_dir: Path) -> list[str]:
    f = job_dir / ".hydra" / "overrides.yaml"
    if not f.exists():
        return []
    try:
        import yaml

        data = yaml.safe_load(f.read_text())
    except Exception:
        return []
    return [str(x) for x in data] if isinstance(data, list) else []


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return e


def collect(sweep_dir: str | Path) -> tuple[list[Run], list[Failure]]:
    """Every run summary and every failed job under ``sweep_dir``, in natural job order."""
    root = Path(sweep_dir)
    runs: list[Run] = []
    failures: list[Failure] = []
    for path in sorted(root.rglob(SUMMARY_FILE), key=lambda p: _natural_key(p.as_posix())):
        data = _read_json(path)
        job = _job_name(path, root)
        if not isinstance(data, dict):
            failures.append(Failure(job, f"unreadable {SUMMARY_FILE}: {data}", type(data).__name__,
                                    _job_overrides(path.parent)))
            continue
        runs.append(Run(job, data, _job_overrides(path.parent)))
    for path in sorted(root.rglob(ERROR_FILE), key=lambda p: _natural_key(p.as_posix())):
        data = _read_json(path)
        job = _job_name(path, root)
        if isinstance(data, dict):
            overrides = [str(o) for o in (data.get("overrides") or [])] or _job_overrides(path.parent)
            failures.append(Failure(job, str(data.get("error", "")).strip() or "(no message)",
                                    data.get("type"), overrides))
        else:
            failures.append(Failure(job, f"unreadable {ERROR_FILE}: {data}", None, _job_overrides(path.parent)))
    _label_runs(runs)
    return runs, failures


def _label_runs(runs: list[Run]) -> None:
    base = [f"{r.summary.get('strategy', '?')} x{r.summary.get('world_size', '?')}" for r in runs]
    for r, b in zip(runs, base):
        r.label = b if base.count(b) == 1 else f"{b} [{r.job}]"


def varying_overrides(runs: Sequence[Run], failures: Sequence[Failure] = ()) -> dict[str, list[str]]:
    """Per job, the overrides that differ between jobs (the sweep point), common ones dropped."""
    all_lists = [r.overrides for r in runs] + [f.overrides for f in failures]
    common = set(all_lists[0]).intersection(*all_lists[1:]) if all_lists else set()
    return {x.job: [o for o in x.overrides if o not in common] for x in [*runs, *failures]}


# ---------------------------------------------------------------------------------------------------
# formatting


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def fmt_bytes(n: Any) -> str:
    v = _num(n)
    return "-" if v is None else units.fmt_bytes(v)


def fmt_count(n: Any) -> str:
    v = _num(n)
    if v is None:
        return "-"
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(v) >= div:
            return f"{v / div:.2f}{suffix}"
    return f"{int(v)}"


def fmt_float(x: Any, digits: int = 4) -> str:
    v = _num(x)
    return "-" if v is None else f"{v:.{digits}f}"


def fmt_rate(x: Any) -> str:
    v = _num(x)
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def fmt_ms(seconds: Any) -> str:
    v = _num(seconds)
    return "-" if v is None else f"{1000 * v:.1f}"


def fmt_pct(x: Any) -> str:
    v = _num(x)
    return "-" if v is None else f"{100 * v:.1f}%"


def fmt_mesh(mesh: Any) -> str:
    if isinstance(mesh, dict) and mesh:
        return " x ".join(f"{k}={v}" for k, v in mesh.items())
    return "-" if not mesh else str(mesh)


def memory_entries(summary: dict[str, Any]) -> list[dict[str, Any]]:
    mem = summary.get("memory")
    if not isinstance(mem, list):
        return []
    entries = [m for m in mem if isinstance(m, dict)]
    return sorted(entries, key=lambda m: _num(m.get("rank")) if _num(m.get("rank")) is not None else math.inf)


def model_state_bytes(entry: dict[str, Any]) -> int | None:
    vals = [_num(entry.get(k)) for k in MEMORY_CATEGORIES]
    return None if all(v is None for v in vals) else int(sum(v for v in vals if v is not None))


def fmt_model_states(summary: dict[str, Any]) -> str:
    per_rank = [model_state_bytes(m) for m in memory_entries(summary)]
    if not per_rank or all(v is None for v in per_rank):
        return "-"
    if len(set(per_rank)) == 1:
        return fmt_bytes(per_rank[0]) + (f" x{len(per_rank)}" if len(per_rank) > 1 else "")
    return " / ".join(fmt_bytes(v) for v in per_rank)


TABLE_COLUMNS = ("job", "strategy", "world size", "mesh", "params", "precision", "global batch", "final loss",
                 "step time (ms)", "samples/s", "tokens/s", "MFU", "model states per rank", "comm per step")


def comm_total(summary: dict[str, Any]) -> int | None:
    """Collective payload bytes per optimizer step (the busiest rank's entries), or None."""
    comm = summary.get("comm")
    return _num(comm.get("total_bytes_per_step")) if isinstance(comm, dict) else None


def table_row(run: Run) -> list[str]:
    s = run.summary
    return [run.job, str(s.get("strategy", "-")), str(s.get("world_size", "-")), fmt_mesh(s.get("mesh")),
            fmt_count(s.get("n_params")), str(s.get("precision", "-")), str(s.get("global_batch_size") or "-"),
            fmt_float(s.get("final_loss")), fmt_ms(s.get("step_time_s")), fmt_rate(s.get("samples_per_s")),
            fmt_rate(s.get("tokens_per_s")), fmt_pct(s.get("mfu")), fmt_model_states(s), fmt_bytes(comm_total(s))]


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(sweep_dir: str | Path, runs: Sequence[Run], failures: Sequence[Failure],
                    images: dict[str, str], plot_problems: Sequence[str] = ()) -> str:
    out = [f"# Sweep report: `{sweep_dir}`", "",
           f"{len(runs)} run(s) with a summary, {len(failures)} failed job(s).", ""]
    if runs:
        out += ["## Runs", "", markdown_table(TABLE_COLUMNS, (table_row(r) for r in runs)), "",
                "Step time: median wall time of an optimizer step after warm-up. Model states per rank: "
                "params + grads + optimizer state held by each rank (local shards). Comm per step: collective "
                "payload bytes per optimizer step (summary `comm`, docs/communication.md).", ""]
        points = varying_overrides(runs, failures)
        if any(points.get(r.job) for r in runs):
            out += ["Sweep points:", ""]
            out += [f"- `{r.job}`: {' '.join(points[r.job]) or '(base)'}" for r in runs]
            out.append("")
        bubbles = [(r, bubble_of(r.summary)) for r in runs]
        bubbles = [(r, b) for r, b in bubbles if b]
        if bubbles:
            out += ["## Pipeline bubble", "",
                    markdown_table(("job", "strategy", "schedule", "stages", "micro-batches", "measured", "theory"),
                                   ([r.job, str(r.summary.get("strategy", "-")), str(b.get("schedule") or "-"),
                                     str(b.get("stages") or "-"), str(b.get("microbatches") or "-"),
                                     fmt_pct(b.get("measured")), fmt_pct(b.get("theory"))] for r, b in bubbles)), ""]
    out += ["## Failed jobs", ""]
    if failures:
        out += [f"- `{f.job}`: {f.type or 'error'}: {f.error}" + (f"  (overrides: `{' '.join(f.overrides)}`)"
                                                                 if f.overrides else "") for f in failures]
    else:
        out.append("None.")
    out.append("")
    if images or plot_problems:
        out += ["## Plots", ""]
        out += [f"- not drawn: {p}" for p in plot_problems] + ([""] if plot_problems else [])
        for name, file in images.items():
            out += [f"### {name}", "", f"![{name}]({file})", ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------
# plots


def bubble_of(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The pipeline bubble record, with normalized keys: measured, theory, stages, microbatches,
    schedule, per_stage. None when the run has none (or nothing measurable)."""
    b = summary.get("bubble")
    if not isinstance(b, dict):
        return None

    def first(*keys: str) -> Any:
        for k in keys:
            if b.get(k) is not None:
                return b[k]
        return None

    measured = _num(first("measured", "bubble", "measured_fraction", "fraction", "idle_fraction"))
    theory = _num(first("theory", "theoretical", "expected", "theory_fraction"))
    per_stage = first("per_stage", "stages_idle", "per_rank")
    micro = _num(first("n_microbatches", "num_microbatches", "microbatches", "n_micro", "n_microbatch",
                       "chunks", "m"))
    stages = _num(first("n_stages", "num_stages", "stages", "pp", "p"))
    if stages is None and isinstance(per_stage, list) and per_stage:
        stages = len(per_stage)
    if stages is None:
        mesh = summary.get("mesh") if isinstance(summary.get("mesh"), dict) else {}
        stages = _num(mesh.get("pp"))
    if measured is None and theory is None:
        return None
    return {"measured": measured, "theory": theory, "per_stage": per_stage if isinstance(per_stage, list) else None,
            "microbatches": int(micro) if micro else None, "stages": int(stages) if stages else None,
            "schedule": first("schedule", "schedule_name", "kind")}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _byte_unit(max_bytes: float) -> tuple[float, str]:
    for scale, unit in ((1024 ** 3, "GiB"), (1024 ** 2, "MiB"), (1024, "KiB")):
        if max_bytes >= scale:
            return scale, unit
    return 1.0, "B"


def _save(fig: Any, path: Path) -> str:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return path.name


def plot_memory(runs: Sequence[Run], out: Path) -> str | None:
    data = [(r, memory_entries(r.summary)) for r in runs]
    data = [(r, m) for r, m in data if m and any(model_state_bytes(e) for e in m)]
    if not data:
        return None
    plt = _pyplot()
    colors = {"params": "#4C72B0", "grads": "#DD8452", "optimizer_state": "#55A868"}
    peak = max(model_state_bytes(e) or 0 for _, m in data for e in m)
    scale, unit = _byte_unit(peak)
    n_bars = sum(len(m) for _, m in data)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * n_bars + 1.2 * len(data)), 4.5))
    x, ticks, tick_labels, group_centers = 0.0, [], [], []
    labelled: set[str] = set()
    for run, entries in data:
        start = x
        for e in entries:
            bottom = 0.0
            for cat in MEMORY_CATEGORIES:
                v = (_num(e.get(cat)) or 0.0) / scale
                ax.bar(x, v, bottom=bottom, width=0.8, color=colors[cat],
                       label=CATEGORY_LABELS[cat] if cat not in labelled else None)
                labelled.add(cat)
                bottom += v
            off = (_num(e.get("offloaded")) or 0.0) / scale
            if off > 0:
                ax.bar(x, min(off, bottom), width=0.8, fill=False, hatch="///", edgecolor="black", linewidth=0.5,
                       label=CATEGORY_LABELS["offloaded"] if "offloaded" not in labelled else None)
                labelled.add("offloaded")
            ticks.append(x)
            tick_labels.append(f"r{e.get('rank', '?')}")
            x += 1.0
        group_centers.append(((start + x - 1.0) / 2, run.label))
        x += 0.8
    ax.set_xticks(ticks, tick_labels, fontsize=7)
    for cx, lab in group_centers:
        ax.text(cx, -0.12, lab, ha="center", va="top", transform=ax.get_xaxis_transform(), fontsize=8)
    ax.set_ylabel(f"model states per rank ({unit})")
    ax.set_title("Memory per rank by category")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, out / "memory.png")


def plot_speed(runs: Sequence[Run], out: Path) -> str | None:
    data = [r for r in runs if _num(r.summary.get("step_time_s")) is not None]
    if not data:
        return None
    plt = _pyplot()
    strategies = list(dict.fromkeys(str(r.summary.get("strategy", "?")) for r in data))
    cmap = plt.get_cmap("tab10")
    colors = [cmap(strategies.index(str(r.summary.get("strategy", "?"))) % 10) for r in data]
    labels = [r.label for r in data]
    has_tokens = any(_num(r.summary.get("tokens_per_s")) for r in data)
    thr_key, thr_label = ("tokens_per_s", "tokens/s") if has_tokens else ("samples_per_s", "samples/s")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8.0, 1.1 * len(data) + 4), 4.2))
    xs = range(len(data))
    ax1.bar(xs, [1000 * _num(r.summary["step_time_s"]) for r in data], color=colors)
    ax1.set_ylabel("step time (ms, median)")
    ax1.set_title("Step time")
    ax2.bar(xs, [_num(r.summary.get(thr_key)) or 0.0 for r in data], color=colors)
    ax2.set_ylabel(thr_label)
    ax2.set_title(f"Throughput ({thr_label})")
    for ax in (ax1, ax2):
        ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, out / "speed.png")


def plot_comm(runs: Sequence[Run], out: Path) -> str | None:
    """Bar per run: collective payload bytes per step, stacked by kind (summary key ``comm``)."""
    data = [r for r in runs if comm_total(r.summary) is not None]
    if not data:
        return None
    plt = _pyplot()
    per_kind = [{k: sum(ax.values()) for k, ax in (r.summary["comm"].get("bytes_per_step") or {}).items()}
                for r in data]
    kinds = list(dict.fromkeys(k for d in per_kind for k in d))
    scale, unit = _byte_unit(max([comm_total(r.summary) or 0 for r in data] + [1]))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(data) + 3), 4.2))
    xs = range(len(data))
    bottom = [0.0] * len(data)
    for i, kind in enumerate(kinds):
        vals = [d.get(kind, 0) / scale for d in per_kind]
        ax.bar(xs, vals, bottom=bottom, label=kind.replace("_", "-"), color=plt.get_cmap("tab10")(i % 10))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(list(xs), [r.label for r in data], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"payload per step ({unit})")
    ax.set_title("Communication per optimizer step (busiest rank)")
    if kinds:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, out / "comm.png")


def plot_losses(runs: Sequence[Run], out: Path) -> str | None:
    data = [(r, [_num(v) for v in r.summary.get("losses") or []]) for r in runs
            if isinstance(r.summary.get("losses"), list)]
    data = [(r, ls) for r, ls in data if any(v is not None for v in ls)]
    if not data:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = ["-", "--", ":", "-."]  # runs that agree (loss parity) lie on top of each other: vary the dashes
    for i, (r, ls) in enumerate(data):
        steps = [j + 1 for j, v in enumerate(ls) if v is not None]
        ax.plot(steps, [v for v in ls if v is not None], linestyle=styles[i % len(styles)], label=r.label,
                linewidth=1.4, alpha=0.85)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (global batch mean)")
    ax.set_title("Loss curves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "loss.png")


def bubble_theory(stages: int, microbatches: float) -> float:
    """GPipe / 1F1B idle fraction: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def plot_bubble(runs: Sequence[Run], out: Path) -> str | None:
    data = [(r, bubble_of(r.summary)) for r in runs]
    data = [(r, b) for r, b in data if b and b["microbatches"] and (b["measured"] is not None or b["theory"] is not None)]
    if not data:
        return None
    plt = _pyplot()
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    m_max = max(b["microbatches"] for _, b in data)
    ms = [m / 4 for m in range(4, 4 * max(2 * m_max, 8) + 1)]
    depths = sorted({b["stages"] for _, b in data if b["stages"]})
    for i, p in enumerate(depths):
        ax.plot(ms, [bubble_theory(p, m) for m in ms], color=cmap(i % 10), alpha=0.6,
                label=f"theory (p-1)/(m+p-1), p={p}")
    groups: dict[str, list[tuple[int, dict]]] = {}
    for r, b in data:
        key = f"{r.summary.get('strategy', '?')}" + (f" {b['schedule']}" if b["schedule"] else "") + \
              (f" p={b['stages']}" if b["stages"] else "")
        groups.setdefault(key, []).append((b["microbatches"], b))
    markers = "osD^v<>"
    for j, (key, pts) in enumerate(groups.items()):
        pts.sort(key=lambda t: t[0])
        p = pts[0][1]["stages"]
        color = cmap(depths.index(p) % 10) if p in depths else "black"
        meas = [(m, b["measured"]) for m, b in pts if b["measured"] is not None]
        if meas:
            ax.plot([m for m, _ in meas], [v for _, v in meas], markers[j % len(markers)], color=color,
                    markersize=7, label=f"measured: {key}", linestyle="-" if len(meas) > 1 else "none", linewidth=0.8)
        theo = [(m, b["theory"]) for m, b in pts if b["theory"] is not None]
        if theo:
            ax.plot([m for m, _ in theo], [v for _, v in theo], markers[j % len(markers)], markerfacecolor="none",
                    color=color, markersize=9, linestyle="none", label=f"reported theory: {key}")
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (idle fraction)")
    ax.set_ylim(bottom=0)
    ax.set_title("Pipeline bubble")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out / "bubble.png")


PLOTS = (("Memory per rank", plot_memory), ("Step time and throughput", plot_speed), ("Loss curves", plot_losses),
         ("Pipeline bubble", plot_bubble), ("Communication per step", plot_comm))


def build_report(sweep_dir: str | Path, out_dir: str | Path | None = None) -> tuple[Path, list[Run], list[Failure]]:
    """Collect, plot and write ``report.md``; returns its path and what was found."""
    sweep_dir = Path(sweep_dir)
    out = Path(out_dir) if out_dir is not None else sweep_dir
    out.mkdir(parents=True, exist_ok=True)
    runs, failures = collect(sweep_dir)
    images, problems = draw_plots(runs, out)
    for p in problems:
        print(f"warning: plot not drawn: {p}", file=sys.stderr)
    report = out / "report.md"
    report.write_text(render_markdown(sweep_dir, runs, failures, images, problems))
    return report, runs, failures


def draw_plots(runs: Sequence[Run], out: Path) -> tuple[dict[str, str], list[str]]:
    """Every plot that has data: ``{title: file}``, and one line per plot that could not be drawn. The
    table is the report's substance, so a plot that fails (or a missing matplotlib, an optional
    dependency: ``pip install 'lightning_par[plots]'``) is reported, not allowed to lose the table."""
    try:
        _pyplot()
    except ImportError as e:
        return {}, [f"all plots: {e} (pip install 'lightning_par[plots]')"]
    images: dict[str, str] = {}
    problems: list[str] = []
    for title, fn in PLOTS:
        try:
            name = fn(runs, out)
        except Exception as e:  # noqa: BLE001 -- see the docstring
            problems.append(f"{title}: {type(e).__name__}: {e}")
            continue
        if name:
            images[title] = name
    return images, problems


class SweepDirectory(Callback):
    """A Hydra callback (``conf/config.yaml``'s ``hydra.callbacks.sweep_dir``): at the end of a multirun, the
    sweep's directory -- what ``lightning-par-report`` reads -- printed as its last line. (A sweep with a
    failed job ends in Hydra's error instead, which names the job's error.json.)"""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        sweep_dir = OmegaConf.select(config, "hydra.sweep.dir")
        if sweep_dir:
            print(f"sweep directory: {sweep_dir}  (lightning-par-report {sweep_dir}: its table and plots)", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir", help="a Hydra sweep (or run) directory; searched recursively")
    ap.add_argument("--out", default=None, help="where report.md and the PNGs go (default: SWEEP_DIR)")
    args = ap.parse_args(argv)
    sweep = Path(args.sweep_dir)
    if not sweep.is_dir():
        print(f"error: {sweep} is not a directory", file=sys.stderr)
        return 2
    if not any(sweep.rglob(SUMMARY_FILE)) and not any(sweep.rglob(ERROR_FILE)):
        print(f"error: no {SUMMARY_FILE} or {ERROR_FILE} under {sweep}", file=sys.stderr)
        return 1
    report, runs, failures = build_report(sweep, args.out)
    print(f"{len(runs)} run(s), {len(failures)} failed job(s) -> {report}")
    for f in failures:
        print(f"  failed: {f.job}: {f.type or 'error'}: {f.error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
