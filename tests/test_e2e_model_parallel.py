"""End-to-end: run.py under the model-parallel strategies (pipeline, tensor_parallel, fsdp_tp, 3d).

Every run's per-step training losses and its validation loss equal the single-device run's (fp32,
same data order), a pipeline checkpoint resumes to the same losses (also into a different number
of stages), the bubble lands in summary.json with its timeline and trace, and bad settings stop
with one line before any process starts.

The runs train with SGD and gradient clipping on purpose: SGD's losses change with any error in
the scale of a gradient (a missing average over data-parallel ranks, micro-batch scaling applied
twice), which Adam's normalization would hide; the clipping threshold is below the gradient norm
in these steps, so a per-stage instead of whole-model norm changes the losses too.

The 13 runs (the single-device reference, 4 pipelines, a checkpointed pipeline and its 3 resumes, 2 tensor-parallel
runs, fsdp_tp, 3d) run one after another in one process (``runs``, ``tests/serial.py``), each as ``python run.py
...`` runs it, in a run directory of its own.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from lightning_par.models import GPTModule
from lightning_par.parallel.pipeline.schedule import theoretical_bubble
from tests import serial
from tests.helpers import assert_losses_match, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test runs all 13 (``runs``)

# gpt_tiny with 4 heads (so tp=4 divides them): 4 pipeline layers (embed, 2 blocks, head)
BASE = ["experiment=quick", "+model.n_head=4", "model.optimizer=sgd", "model.lr=0.1", "trainer.gradient_clip_val=0.5",
        "trainer.max_steps=12", "trainer.val_check_interval=6", "trainer.limit_val_batches=2",
        "trainer.enable_progress_bar=false"]

PIPELINES = [
    # with gradient accumulation: 2 pipeline steps of 4 samples per optimizer step (validation every 6 steps)
    ("gpipe", 2, 2, ["trainer.accumulate_grad_batches=2", "trainer.val_check_interval=12"]),
    ("1f1b", 4, 4, []),
    ("gpipe", 4, 1, []),  # naive model parallelism: one micro-batch, one stage busy at a time
    ("interleaved_1f1b", 2, 4, []),  # two stages per rank (loop placement): 4 stages on 2 ranks
]
TENSOR_PARALLEL = [
    (2, []),
    (4, ["strategy.sequence_parallel=true", "strategy.loss_parallel=true"]),
]
CKPT = ["callbacks=checkpoint", "callbacks.checkpoint.every_n_train_steps=6"]
PIPE = ["strategy=pipeline", "strategy.n_microbatches=4"]
# the pipeline checkpoint of step 6 (1f1b on 2 ranks) resumed: a directory, every rank wrote its own layers
RESUMES = {
    "same": PIPE + ["trainer.devices=2"],
    "4 stages": PIPE + ["trainer.devices=4", "strategy.schedule=gpipe"],  # other cut, other schedule
    "single device": ["strategy=single"],  # the shared format: any strategy loads it
}


def _jobs(root: Path) -> dict[str, list[str]]:
    """Every run of this module (name -> run.py's arguments after BASE), in the order they run: the resumes
    after the run whose checkpoint they load."""
    ckpt = root / "pipeline-ckpt" / "checkpoints" / "step000006.ckpt"
    return {
        "single": [],
        **{f"pipeline-{s}-{d}-{m}": ["strategy=pipeline", f"trainer.devices={d}", f"strategy.schedule={s}",
                                     f"strategy.n_microbatches={m}", *extra] for s, d, m, extra in PIPELINES},
        "pipeline-ckpt": PIPE + CKPT + ["trainer.devices=2"],
        **{f"resume-{name}": [*args, f"ckpt_path={ckpt}"] for name, args in RESUMES.items()},
        **{f"tensor_parallel-{d}": ["strategy=tensor_parallel", f"trainer.devices={d}", *extra]
           for d, extra in TENSOR_PARALLEL},
        "fsdp_tp": ["strategy=fsdp_tp", "trainer.devices=4", "strategy.tp=2"],
        "3d": ["strategy=3d", "trainer.devices=8"],  # pp=2 x dp=2 (FSDP) x tp=2 on 8 processes
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, serial.Run]:
    """Every run of this module one after another in one process (``tests/serial.py``: each as ``python run.py
    ...`` runs it; the ranks' fork server started once, not 13 times: 49 s instead of 91 s on this machine)."""
    root = tmp_path_factory.mktemp("runs")
    return serial.app_runs({name: [*BASE, *args] for name, args in _jobs(root).items()}, root, timeout=1200)


def summary_of(runs: dict[str, serial.Run], name: str) -> tuple[dict, Path]:
    """The run's summary.json (it failed: its output) and its run directory."""
    return runs[name].summary(), runs[name].dir


def val_losses(run_dir: Path) -> list[float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return [float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")]


@pytest.fixture(scope="module")
def ref(runs) -> dict:
    s, run_dir = summary_of(runs, "single")
    s["val"] = val_losses(run_dir)
    assert len(s["val"]) == 2 and s["losses"][-1] < s["losses"][0]
    return s


def assert_matches(s: dict, run_dir: Path, ref: dict) -> None:
    assert_losses_match(s, ref)
    np.testing.assert_allclose(val_losses(run_dir), ref["val"], rtol=1e-5, err_msg="validation loss")


@pytest.mark.parametrize("schedule, devices, m, extra", PIPELINES)
def test_pipeline_matches_single(ref, runs, schedule, devices, m, extra):
    s, run_dir = summary_of(runs, f"pipeline-{schedule}-{devices}-{m}")
    assert s["mesh"] == {"pp": devices}
    assert_matches(s, run_dir, ref)
    # every rank holds only its stages: together, the parameters of one model
    (single_mem,) = ref["memory"]
    assert sum(r["params"] for r in s["memory"]) == single_mem["params"] == 4 * s["n_params"]
    assert all(r["params"] < single_mem["params"] for r in s["memory"])
    b = s["bubble"]
    v = 2 if schedule == "interleaved_1f1b" else 1
    assert (b["schedule"], b["pp"], b["n_microbatches"], b["virtual_stages"]) == (schedule, devices, m, v)
    assert b["theory"] == pytest.approx(theoretical_bubble(schedule, devices, m, v))
    calls = 12 * (2 if extra else 1)  # schedule calls: one per batch
    assert 0 < b["measured"] < 1 and b["measured_steps"] == calls - 2
    assert [st["pp_rank"] for st in b["per_stage"]] == list(range(devices))
    assert all(len(st["stages"]) == v and st["busy_s"] > 0 for st in b["per_stage"])
    # consistent numbers, no timing thresholds (tests/test_bubble.py checks the values on a deterministic
    # clock): each rank's idle fraction of the pipeline's step, busy time split over its stages, the mean
    for st in b["per_stage"]:
        assert 0 < st["busy_s"] <= st["wall_s"] and st["bubble"] == pytest.approx(1 - st["busy_s"] / st["wall_s"])
        assert sum(st["busy_s_by_stage"].values()) == pytest.approx(st["busy_s"])
        assert sorted(map(int, st["busy_s_by_stage"])) == sorted(st["stages"])
    assert len({st["wall_s"] for st in b["per_stage"]}) == 1  # one step wall for the whole pipeline
    assert b["measured"] == pytest.approx(sum(st["bubble"] for st in b["per_stage"]) / devices)
    trace = json.loads((run_dir / "pipeline_trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(devices)) and {e["name"][0] for e in spans} >= {"F", "B"}
    assert (run_dir / "pipeline_timeline.png").read_bytes()[:4] == b"\x89PNG"


def _logged_steps(run_dir: Path) -> list[int]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]


def test_pipeline_checkpoint_resumes_in_any_layout(ref, runs):
    full, full_dir = summary_of(runs, "pipeline-ckpt")
    assert_losses_match(full, ref)  # (1f1b on 2 ranks, with checkpointing)
    ckpt = full_dir / "checkpoints" / "step000006.ckpt"  # a directory: every rank wrote its own layers
    assert (ckpt / "meta.pt").is_file() and (ckpt / ".metadata").is_file() and len(list(ckpt.glob("*.distcp"))) == 2
    for name, args in RESUMES.items():
        assert f"ckpt_path={ckpt}" in runs[f"resume-{name}"].job.args, name
        s, run_dir = summary_of(runs, f"resume-{name}")
        assert min(_logged_steps(run_dir)) >= 6, name  # it trained steps 7..12 only (mid-epoch resume)
        np.testing.assert_allclose(s["losses"], full["losses"], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("devices, extra", TENSOR_PARALLEL)
def test_tensor_parallel_matches_single(ref, runs, devices, extra):
    s, run_dir = summary_of(runs, f"tensor_parallel-{devices}")
    assert s["mesh"] == {"tp": devices} and s["bubble"] is None
    assert_matches(s, run_dir, ref)
    (single_mem,) = ref["memory"]
    assert all(r["params"] < single_mem["params"] / devices * 1.5 for r in s["memory"])  # split, bar the small rest


@pytest.mark.timeout(900)  # the shared sweep: 8 runs of 60 steps, about 4 minutes on 2 cores
@pytest.mark.parametrize("strategy", ["tensor_parallel", "pipeline"])
def test_two_ranks_match_single_over_60_steps(strategy):
    """The long-horizon parity of test_e2e_sharded.py (one shared 2-rank sweep, SGD, 60 steps, rtol
    1e-6) for tensor and pipeline parallelism."""
    from tests.sweeps import assert_parity_over_horizon, long_parity

    s = long_parity()[strategy]
    assert s["world_size"] == 2 and s["mesh"] == ({"tp": 2} if strategy == "tensor_parallel" else {"pp": 2})
    assert_parity_over_horizon(s, long_parity()["single"])


def test_fsdp_tp_matches_single(ref, runs):
    s, run_dir = summary_of(runs, "fsdp_tp")
    assert s["mesh"] == {"dp_shard": 2, "tp": 2}
    assert_matches(s, run_dir, ref)
    (single_mem,) = ref["memory"]
    # a quarter of the model each (dp x tp shards), plus the small tensors TP replicates (LayerNorms)
    assert all(r["params"] < 0.3 * single_mem["params"] for r in s["memory"])


def test_3d_matches_single(ref, runs):
    # pp=2 x dp=2 (FSDP) x tp=2 on 8 processes: about a minute on two cores
    s, run_dir = summary_of(runs, "3d")
    assert s["mesh"] == {"pp": 2, "dp_shard": 2, "tp": 2}
    assert_matches(s, run_dir, ref)
    assert s["bubble"]["pp"] == 2 and len(s["bubble"]["per_stage"]) == 2


@pytest.mark.parametrize("args, pattern", [
    (["strategy=pipeline", "trainer.devices=4", "strategy.schedule=1f1b", "strategy.n_microbatches=2"],
     r"1f1b needs n_microbatches >= pipeline stages per step \(pp=4\)"),
    (["strategy=tensor_parallel", "trainer.devices=4"], r"tp=4 does not divide n_head=2"),
    (["strategy=3d", "trainer.devices=6"], r"pp=2 x tp=2 = 4 does not divide the world size 6"),
])
def test_bad_settings_are_one_line(tmp_path, args, pattern):
    proc = run_cli(["experiment=quick", *args], tmp_path, timeout=90, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    import re

    assert re.search(pattern, lines[0]), lines[0]


# ---------------------------------------------------------------------------------------------
# validation in one process (no training): each mistake is one line before processes start


def _strategy(kind: str, **kw):
    from lightning_par.strategies.composite import FSDPTPStrategy, Parallel3DStrategy
    from lightning_par.strategies.pipeline import PipelineStrategy
    from lightning_par.strategies.tensor_parallel import TensorParallelStrategy

    return {"pipeline": PipelineStrategy, "tp": TensorParallelStrategy, "fsdp_tp": FSDPTPStrategy,
            "3d": Parallel3DStrategy}[kind](**kw)


TINY = dict(preset="gpt_tiny", seq_len=32)  # 2 heads, 2 blocks: 4 layers


@pytest.mark.parametrize("kind, kw, world, model, pattern", [
    ("pipeline", {}, 8, {}, r"cannot cut 4 layers into 8 pipeline stages"),
    ("pipeline", dict(schedule="interleaved_1f1b", n_microbatches=4), 4, {}, r"cannot cut 4 layers into 8 pipeline"),
    ("pipeline", dict(schedule="gpipe", virtual_stages=2), 2, {}, r"runs one stage per rank"),
    ("pipeline", dict(split_points=["net.blocks.9"]), 2, {}, r"split point 'net.blocks.9' is not one of"),
    ("pipeline", dict(split_points=[1, 2]), 2, {}, r"2 pipeline stages need 1 split points, got 2"),
    ("pipeline", dict(pp=3), 4, {}, r"pp=3 does not divide the world size 4"),
    ("tp", {}, 3, {}, r"tp=3 does not divide n_head=2"),
    ("tp", dict(tp=2), 2, dict(n_head=2, vocab_size=255), r"tp=2 does not divide vocab_size=255"),
    ("fsdp_tp", dict(tp=4), 8, {}, r"tp=4 does not divide n_head=2"),
    ("fsdp_tp", dict(tp=4), 6, dict(n_head=4), r"FSDPTPStrategy: tp=4 does not divide the world size 6"),
    ("3d", dict(schedule="interleaved_1f1b", n_microbatches=2), 4, dict(n_layer=1),
     r"cannot cut 3 layers into 4 pipeline stages \(pp=2 x virtual_stages=2\)"),
    ("3d", dict(pp=2, tp=4), 8, {}, r"tp=4 does not divide n_head=2"),
    ("3d", dict(n_microbatches=1), 8, dict(n_head=4), r"needs n_microbatches >= pipeline stages"),
])
def test_validate_setup_errors(kind, kw, world, model, pattern):
    strategy = _strategy(kind, **kw)
    with pytest.raises(ValueError, match=pattern) as info:
        strategy.validate_setup(world, GPTModule(**TINY, **model))
    assert "\n" not in str(info.value)


def test_model_without_plan_is_refused():
    import lightning as L
    from torch import nn

    class NoPlan(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 2)

    for kind, pattern in [("pipeline", r"where NoPlan may be cut; declare parallel_plan\(\)\.layers"),
                          ("tp", r"needs NoPlan's tensor-parallel styles; declare parallel_plan\(\)\.tp_plan")]:
        with pytest.raises(ValueError, match=pattern):
            _strategy(kind).validate_setup(2, NoPlan())


def test_batch_must_split_into_microbatches():
    strategy = _strategy("pipeline", n_microbatches=3)
    with pytest.raises(ValueError, match=r"batch of 8 samples per pipeline does not split into n_microbatches=3"):
        strategy.validate_batch(8, 2)
    strategy.validate_batch(9, 2)
