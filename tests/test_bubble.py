"""Pipeline bubble and activation memory, measured on gloo ranks with layer-1 pipelines, and the
bubble monitor's summary, trace, timeline and sweep figure.

The bubble is checked on a synthetic pipeline whose every stage is compute-balanced by
construction: its forward sleeps ``T_F`` and its backward ``T_B`` (a custom autograd function), so
the times do not depend on how busy the shared CPU is. GPipe and 1F1B must then idle
``(p-1)/(m+p-1)`` of the step, up to ``MARGIN`` (what is left is communication and Python overhead
between the sleeps, counted as idle), and the idle fraction must fall as the micro-batches grow.

Activation memory is measured with ``ActivationMeter`` (saved-tensors hooks around the stage's
forward, see ``callbacks/bubble.py``): it counts exactly the bytes autograd keeps for backward, so
GPipe (all m micro-batches alive after the forward phase) and 1F1B (at most p on the first stage)
can be compared on CPU, where allocator statistics do not exist and the RSS is noise.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_par.callbacks.bubble import (
    ActivationMeter,
    bubble_summary,
    draw_timeline,
    plot_bubble_sweep,
    write_trace,
)
from lightning_par.parallel.pipeline import build_schedule, theoretical_bubble
from tests.dist import run_distributed

T_F, T_B = 0.02, 0.04  # seconds of forward / backward per stage and micro-batch
P = 4
MARGIN = 0.06  # |measured - theory| on the balanced pipeline (measured on 2 shared cores: within 0.04)
BUBBLE_CASES = [("gpipe", 1), ("gpipe", 2), ("gpipe", 4), ("gpipe", 8), ("1f1b", 4), ("1f1b", 8)]
MEMORY_M = 8


class _SleepOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, t_f, t_b):  # type: ignore[override]
        time.sleep(t_f)
        ctx.t_b = t_b
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(ctx.t_b)
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(), None, None


class SleepStage(nn.Module):
    """A pipeline stage with fixed compute time: forward sleeps t_f, backward t_b."""

    def __init__(self, t_f: float = T_F, t_b: float = T_B) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.t_f, self.t_b = t_f, t_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepOp.apply(x, self.w, self.t_f, self.t_b)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _worker(rank: int, world_size: int) -> dict:
    results: dict = {"bubble": {}, "memory": {}}
    for schedule, m in BUBBLE_CASES:
        pipe = build_schedule([SleepStage()], schedule=schedule, n_microbatches=m, loss_fn=_mse, stage_indices=[rank])
        x, y = torch.randn(2 * m, 8), torch.randn(2 * m, 8)
        steps = []
        for step in range(3):
            pipe.step(x, y)
            if step:  # the first step infers shapes
                stats = pipe.bubble()
                steps.append((stats["busy_s"], stats["wall_s"]))
        results["bubble"][(schedule, m)] = steps
    for schedule in ("gpipe", "1f1b"):
        torch.manual_seed(0)
        stage = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
        meter = ActivationMeter().attach(stage)
        pipe = build_schedule([stage], schedule=schedule, n_microbatches=MEMORY_M, loss_fn=_mse, stage_indices=[rank])
        x, y = torch.randn(4 * MEMORY_M, 32), torch.randn(4 * MEMORY_M, 32)
        pipe.step(x, y)
        meter.reset_peak()  # steady state: the second step
        pipe.step(x, y)
        results["memory"][schedule] = {"peak": meter.peak, "live_after": meter.live}
        meter.detach()
    return results


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_distributed(_worker, P, timeout=240)


def _overall(measured: list[dict], case: tuple[str, int]) -> float:
    # a step lasts as long as the pipeline's longest rank (the last stage is done early and waits)
    per_rank = [r["bubble"][case] for r in measured]
    walls = [max(steps[i][1] for steps in per_rank) for i in range(len(per_rank[0]))]
    return sum(1 - sum(b for b, _ in steps) / sum(walls) for steps in per_rank) / len(per_rank)


@pytest.mark.slow
def test_measured_bubble_matches_theory_on_balanced_stages(measured: list[dict]) -> None:
    overall = {case: _overall(measured, case) for case in BUBBLE_CASES}
    for (schedule, m), value in overall.items():
        theory = theoretical_bubble(schedule, P, m)
        assert value == pytest.approx(theory, abs=MARGIN), (schedule, m, value, theory)
    gpipe = [overall[("gpipe", m)] for m in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(gpipe, gpipe[1:])), gpipe  # more micro-batches, smaller bubble
    assert overall[("gpipe", 1)] > 0.7  # naive model parallelism: one stage busy at a time, (p-1)/p idle


@pytest.mark.slow
def test_1f1b_keeps_fewer_activations_than_gpipe_on_the_first_stage(measured: list[dict]) -> None:
    first = measured[0]["memory"]
    gpipe, one_f_one_b = first["gpipe"]["peak"], first["1f1b"]["peak"]
    assert 0 < one_f_one_b < gpipe
    # GPipe holds all m micro-batches' activations, 1F1B on stage 0 at most p of them (plus, in both,
    # the storage of the whole input batch, which the micro-batches are views of: hence not exactly p/m)
    assert one_f_one_b / gpipe == pytest.approx(P / MEMORY_M, rel=0.15)
    # the last stage runs each backward right after its forward under 1F1B: one micro-batch alive
    last = measured[-1]["memory"]
    assert last["1f1b"]["peak"] == pytest.approx(last["gpipe"]["peak"] / MEMORY_M, rel=0.3)
    for r in measured:
        for v in r["memory"].values():
            assert v["live_after"] == 0  # everything saved was released after backward


def test_activation_meter_counts_saved_tensors_once_and_releases_them() -> None:
    lin = nn.Linear(16, 16)
    meter = ActivationMeter().attach(lin)
    x = torch.randn(4, 16, requires_grad=True)
    out = lin(x)
    assert meter.live == x.numel() * 4  # the input is saved; the weight (a parameter) is not counted
    with torch.no_grad():
        lin(x)  # nothing saved without grad
    assert meter.live == x.numel() * 4
    out.sum().backward()
    assert meter.live == 0 and meter.peak == x.numel() * 4
    meter.detach()
    lin(x).sum().backward()
    assert meter.peak == x.numel() * 4


def _record(rank: int, pp_rank: int, replica: int = 0) -> dict:
    t = 100.0
    events = [(pp_rank, "F", 0, t + 0.01 * pp_rank, t + 0.01 * pp_rank + 0.01),
              (pp_rank, "B", 0, t + 0.05 - 0.02 * pp_rank, t + 0.07 - 0.02 * pp_rank)]
    return {"rank": rank, "pp_rank": pp_rank, "replica": replica, "stages": [pp_rank], "n": 2, "busy": [0.03, 0.03],
            "wall": [0.08, 0.07 - 0.01 * pp_rank], "busy_by_stage": {pp_rank: 0.06}, "activations": {pp_rank: 1024},
            "steps": [{"step": 3, "start": t, "end": t + 0.08, "events": events}]}


INFO = {"schedule": "gpipe", "pp": 2, "n_microbatches": 1, "virtual_stages": 1, "pp_rank": 0, "replica": 0,
        "stages": [0]}


def test_bubble_summary_trace_and_timeline(tmp_path) -> None:
    ranks = [_record(0, 0), _record(1, 1), _record(2, 0, replica=1), _record(3, 1, replica=1)]
    s = bubble_summary(ranks, INFO)
    assert s["theory"] == pytest.approx(0.5)
    assert s["measured"] == pytest.approx(1 - 0.06 / (0.08 + 0.07))  # step walls: the longest rank of each step
    assert [p["rank"] for p in s["per_stage"]] == [0, 1]  # one pipeline (replica 0)
    assert s["per_stage"][0]["busy_s"] == pytest.approx(0.03)
    assert s["per_stage"][0]["peak_activation_bytes"] == {"0": 1024}
    assert {k for k in ("measured", "theory", "per_stage", "schedule", "n_microbatches", "pp")} <= set(s)

    write_trace(ranks, str(tmp_path / "trace.json"), INFO)
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 8 and {e["pid"] for e in spans} == {0, 1, 2, 3} and {e["tid"] for e in spans} == {0, 1}
    first = min(spans, key=lambda e: e["ts"])
    assert first["ts"] == pytest.approx(0.0) and first["dur"] == pytest.approx(1e4) and first["name"] == "F0"

    pytest.importorskip("matplotlib")
    assert draw_timeline(ranks, str(tmp_path / "timeline.png"), INFO, s)
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_bubble_sweep_figure(tmp_path, capsys) -> None:
    for i, (m, measured) in enumerate([(1, 0.8), (2, 0.6), (4, 0.45)]):
        job = tmp_path / str(i)
        job.mkdir()
        bubble = {"schedule": "gpipe", "pp": 4, "virtual_stages": 1, "n_microbatches": m, "measured": measured,
                  "theory": theoretical_bubble("gpipe", 4, m)}
        (job / "summary.json").write_text(json.dumps({"bubble": bubble, "step_time_s": 0.1}))
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "summary.json").write_text(json.dumps({"bubble": None}))  # a non-pipeline job
    pytest.importorskip("matplotlib")
    path = plot_bubble_sweep(str(tmp_path))
    assert path and (tmp_path / "bubble_vs_microbatches.png").exists()
    rows = json.loads((tmp_path / "bubble_sweep.json").read_text())
    assert [r["n_microbatches"] for r in rows] == [1, 2, 4]
    assert "gpipe" in capsys.readouterr().out
