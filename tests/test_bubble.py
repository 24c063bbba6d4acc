"""Pipeline bubble and activation memory, measured on gloo ranks with layer-1 pipelines, and the
bubble monitor's summary, trace, timeline and sweep figure.

The bubble is measured on a deterministic clock, not on wall time: the pipeline's ``StageTimer``
reads an injected ``FakeClock`` (``build_schedule(clock=...)``) that moves only when a stage
computes -- ``T_F`` per forward, ``T_B`` per backward (a custom autograd function) -- so what a real
schedule records on 4 gloo ranks is exact: every forward, backward and loss of the rank, each
lasting its known time. Waiting costs no time on that clock, so the schedule's timing is then
replayed from each rank's recorded order: every action starts when its rank is free and its input
is there (a forward after the previous stage's forward of that micro-batch, a backward after the
next stage's backward) -- the pipeline with free communication. Measured through the monitor's own
``BubbleMeter`` and ``bubble_summary``, GPipe and 1F1B must idle exactly ``(p-1)/(m+p-1)`` of the
step and interleaved 1F1B ``(p-1)/(v m+p-1)``, and a stage twice as slow must show as a larger
bubble.

Activation memory is measured with ``ActivationMeter`` (saved-tensors hooks around the stage's
forward, see ``callbacks/bubble.py``): it counts exactly the bytes autograd keeps for backward, so
GPipe (all m micro-batches alive after the forward phase) and 1F1B (at most p on the first stage)
can be compared on CPU, where allocator statistics do not exist and the RSS is noise.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_par.callbacks.bubble import ActivationMeter, BubbleMeter, bubble_summary
from lightning_par.callbacks.bubble_render import draw_timeline, plot_bubble_sweep, write_trace
from lightning_par.parallel.pipeline.schedule import StageTimer, build_schedule, stage_indices_for_rank, theoretical_bubble
from tests.dist import run_distributed

T_F, T_B = 1.0, 2.0  # clock seconds of forward / backward per stage and micro-batch (exact in binary)
P = 4
BUBBLE_CASES = [("gpipe", 1), ("gpipe", 2), ("gpipe", 4), ("gpipe", 8), ("1f1b", 4), ("1f1b", 8),
                ("interleaved_1f1b", 4), ("interleaved_1f1b", 8)]
V = {"interleaved_1f1b": 2}  # stages per rank (loop placement); 1 for the others
MEMORY_M = 8


class FakeClock:
    """Seconds that pass only when ``advance`` is called."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _TickOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, clock, t_f, t_b):  # type: ignore[override]
        clock.advance(t_f)
        ctx.clock, ctx.t_b = clock, t_b
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.clock.advance(ctx.t_b)
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(), None, None, None


class TickStage(nn.Module):
    """A pipeline stage whose forward takes ``T_F`` and backward ``T_B`` on ``clock``."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.clock = clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TickOp.apply(x, self.w, self.clock, T_F, T_B)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _worker(rank: int, world_size: int) -> dict:
    results: dict = {"bubble": {}, "memory": {}}
    for schedule, m in BUBBLE_CASES:
        clock, v = FakeClock(), V.get(schedule, 1)
        stages = stage_indices_for_rank(schedule, rank, world_size, v)
        pipe = build_schedule([TickStage(clock) for _ in stages], schedule=schedule, n_microbatches=m, loss_fn=_mse,
                              stage_indices=stages, virtual_stages=v, clock=clock)
        x, y = torch.randn(2 * m, 8), torch.randn(2 * m, 8)
        for _ in range(2):  # the first step infers shapes; the second is recorded
            pipe.step(x, y)
        timer = pipe.timer
        results["bubble"][(schedule, m)] = {"events": [tuple(e) for e in timer.events],
                                            "wall": timer.step_end - timer.step_start}
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


def replay(orders: list[list[tuple[int, str, int, float]]], n_stages: int) -> list[StageTimer]:
    """Each rank's actions ``(stage, kind, micro-batch, seconds)`` in its recorded order, timed again
    on a clock of its own: an action starts when the rank is free and its input has arrived (free
    communication). Returns the ranks' timers, as a real schedule call leaves them."""
    clocks = [FakeClock() for _ in orders]
    timers = [StageTimer(clock=c) for c in clocks]
    for t in timers:
        t.begin_step()
    done: dict[tuple[str, int, int], float] = {}
    pos = [0] * len(orders)
    while any(i < len(o) for i, o in zip(pos, orders)):
        moved = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                stage, kind, mb, seconds = order[pos[r]]
                dep = {"F": ("F", stage - 1, mb) if stage > 0 else None,
                       "B": ("B", stage + 1, mb) if stage < n_stages - 1 else None}.get(kind)
                if dep is not None and dep not in done:
                    break
                clocks[r].now = max(clocks[r].now, done.get(dep, 0.0))
                with timers[r].record(stage, kind, mb):
                    clocks[r].advance(seconds)
                done[(kind, stage, mb)] = clocks[r].now
                pos[r] += 1
                moved = True
        assert moved, f"the recorded orders deadlock: {pos}"
    for t in timers:
        t.end_step()
    return timers


def _summary(timers: list[StageTimer], schedule: str, m: int) -> dict:
    """``bubble_summary`` of one step of these ranks' timers, as BubbleMonitor measures and gathers it."""
    records = []
    for rank, timer in enumerate(timers):
        meter = BubbleMeter()
        meter.add(timer, step=1)
        records.append(meter.record(rank=rank, pp_rank=rank, replica=0, stages=sorted({e.stage for e in timer.events})))
    info = {"schedule": schedule, "pp": len(timers), "n_microbatches": m, "virtual_stages": V.get(schedule, 1)}
    return bubble_summary(records, info)


def _orders(measured: list[dict], case: tuple[str, int]) -> list[list[tuple[int, str, int, float]]]:
    return [[(stage, kind, mb, end - start) for stage, kind, mb, start, end in r["bubble"][case]["events"]]
            for r in measured]


@pytest.mark.slow
def test_the_real_schedule_records_every_action_with_its_time(measured: list[dict]) -> None:
    for schedule, m in BUBBLE_CASES:
        v = V.get(schedule, 1)
        for rank, r in enumerate(measured):
            got = r["bubble"][(schedule, m)]
            stages = stage_indices_for_rank(schedule, rank, P, v)
            kinds = Counter((stage, kind) for stage, kind, _, _, _ in got["events"])
            want = Counter({(s, k): m for s in stages for k in "FB"} | ({(P * v - 1, "L"): m} if rank == P - 1 else {}))
            assert kinds == want, (schedule, m, rank, kinds)
            for stage, kind, mb, start, end in got["events"]:
                assert end - start == {"F": T_F, "B": T_B, "L": 0.0}[kind], (schedule, m, rank, kind, mb)
            # the clock moves only while a stage computes: the recorded step is all busy time
            assert got["wall"] == v * m * (T_F + T_B)


@pytest.mark.slow
def test_measured_bubble_equals_theory_on_balanced_stages(measured: list[dict]) -> None:
    overall = {}
    for schedule, m in BUBBLE_CASES:
        v = V.get(schedule, 1)
        s = _summary(replay(_orders(measured, (schedule, m)), P * v), schedule, m)
        theory = theoretical_bubble(schedule, P, m, v)
        assert s["theory"] == theory and s["measured_steps"] == 1
        assert s["measured"] == pytest.approx(theory, rel=1e-12, abs=1e-12), (schedule, m, s["measured"], theory)
        for st in s["per_stage"]:  # every rank: v m forwards and backwards in a step of (v m + p - 1) of them
            assert st["busy_s"] == v * m * (T_F + T_B) and st["wall_s"] == (v * m + P - 1) * (T_F + T_B)
            assert st["busy_s_by_stage"] == {str(i): m * (T_F + T_B)
                                             for i in stage_indices_for_rank(schedule, st["pp_rank"], P, v)}
        overall[(schedule, m)] = s["measured"]
    gpipe = [overall[("gpipe", m)] for m in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(gpipe, gpipe[1:])), gpipe  # more micro-batches, smaller bubble
    assert overall[("gpipe", 1)] == pytest.approx(0.75)  # naive model parallelism: one stage busy at a time


@pytest.mark.slow
def test_a_slow_stage_shows_as_a_larger_bubble(measured: list[dict]) -> None:
    """The theory assumes equal stages; measured on the same schedule with stage 1 twice as slow,
    the bubble grows (the other ranks wait on it) and stage 1 idles least."""
    m = 4
    orders = [[(stage, kind, mb, 2 * sec if stage == 1 else sec) for stage, kind, mb, sec in order]
              for order in _orders(measured, ("gpipe", m))]
    s = _summary(replay(orders, P), "gpipe", m)
    assert s["measured"] > theoretical_bubble("gpipe", P, m) + 0.05
    idle = [st["bubble"] for st in s["per_stage"]]
    assert min(idle) == idle[1], idle


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


def test_bubble_meter_reads_the_timer_on_an_injected_clock() -> None:
    """One rank's schedule call on a fake clock: busy = the recorded actions, wall = the call, the
    events shifted onto the wall clock by the meter's offset."""
    clock = FakeClock()
    timer = StageTimer(clock=clock)
    meter = BubbleMeter(keep_steps=1, offset=100.0)
    for step in range(2):
        timer.begin_step()
        clock.advance(1.0)  # waiting for the first activation
        with timer.record(0, "F", 0):
            clock.advance(T_F)
        clock.advance(0.5)
        with timer.record(0, "B", 0):
            clock.advance(T_B)
        timer.end_step()
        assert meter.add(timer, step=step) == pytest.approx(1.5 / 4.5)
    assert meter.busy == [3.0, 3.0] and meter.wall == [4.5, 4.5] and meter.busy_by_stage == {0: 6.0}
    (kept,) = meter.steps  # keep_steps=1: the last step only
    assert kept["step"] == 1 and (kept["start"], kept["end"]) == (104.5, 109.0)
    assert kept["events"] == [(0, "F", 0, 105.5, 106.5), (0, "B", 0, 107.0, 109.0)]
    record = meter.record(rank=3, pp_rank=0, replica=1, stages=[0], activations={0: 64})
    assert record["n"] == 2 and record["activations"] == {0: 64} and record["replica"] == 1


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
    path = plot_bubble_sweep(str(tmp_path))
    assert path and (tmp_path / "bubble_vs_microbatches.png").exists()
    rows = json.loads((tmp_path / "bubble_sweep.json").read_text())
    assert [r["n_microbatches"] for r in rows] == [1, 2, 4]
    assert "gpipe" in capsys.readouterr().out


def test_summary_prints_a_bubble_nothing_measured():
    """A pipeline run too short to measure a step past the first has a bubble of None: the printed
    table says so (it raised a TypeError at the end of a 2-step 3d run, leaving error.json)."""
    from lightning_par.callbacks.summary import format_summary

    s = {"strategy": "3d", "world_size": 4, "mesh": {"pp": 2, "tp": 2}, "model": "m", "n_params": 1e6,
         "precision": "32-true", "steps": 2, "global_batch_size": 8, "losses": [1.0, 0.9], "final_loss": 0.9,
         "bubble": {"measured": None, "theory": 0.2}}
    assert "pipeline bubble measured n/a  theory 0.200" in format_summary(s)
