"""lightning_par/tools/report.py (``lightning-par-report``) on hand-made summaries (every contract key, pipelines
with a bubble, offload, nulls, failed jobs) and on real sweeps; and robust jobs: every failure leaves
error.json, the other jobs of a sweep still run (a BaseException such as torch's CheckpointException
included), the sweep exits nonzero, a single run exits 2 on a ConfigError, and torchrun does not restart
a run whose configuration is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_par.tools.report as report
from lightning_par.callbacks import CONTRACT_KEYS
from tests import launch
from tests.helpers import QUICK, ROOT, assert_losses_match, run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_summary(strategy: str, world: int, *, mesh: dict | None = None, n_steps: int = 12, start: float = 5.5,
                 step_time: float | None = 0.05, offload: bool = False, shard: bool = False, bubble=None,
                 mfu: float | None = None) -> dict:
    n = 1_000_000
    per = 4 * n // world if shard else 4 * n
    memory = [{"rank": r, "params": per, "grads": per, "optimizer_state": 2 * per,
               "offloaded": 3 * per if offload else 0, "peak_allocated": None, "peak_rss": 500 * 2 ** 20}
              for r in range(world)]
    losses = [start - 0.2 * i for i in range(n_steps)]
    s = {"strategy": strategy, "world_size": world, "mesh": mesh or {"dp_replicate": world}, "model": "gpt_small",
         "n_params": n, "precision": "32-true", "global_batch_size": 32, "steps": n_steps, "losses": losses,
         "final_loss": losses[-1], "step_time_s": step_time,
         "samples_per_s": 32 / step_time if step_time else None,
         "tokens_per_s": 32 * 128 / step_time if step_time else None, "mfu": mfu, "memory": memory, "bubble": bubble}
    assert set(CONTRACT_KEYS) <= set(s)
    return s


def _write(job_dir: Path, name: str, data) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / name).write_text(json.dumps(data) if not isinstance(data, str) else data)


def _run_report(sweep: Path, out: Path | None = None, timeout: float = 120,
                entry: tuple[str, ...] = ("-m", "lightning_par.tools.report")) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *entry, str(sweep)] + (["--out", str(out)] if out else [])
    return launch.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _assert_pngs(out: Path, names: list[str]) -> None:
    for name in names:
        p = out / name
        assert p.exists(), f"{name} missing; have {sorted(x.name for x in out.iterdir())}"
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000, (name, len(data))


def test_report_from_fake_summaries(tmp_path):
    sweep = tmp_path / "sweep"
    _write(sweep / "0", "summary.json", fake_summary("single", 1, step_time=0.08))
    _write(sweep / "1", "summary.json", fake_summary("ddp", 2, step_time=0.05, mfu=0.123))
    _write(sweep / "2", "summary.json", fake_summary("zero3", 4, mesh={"dp_shard": 4}, shard=True, offload=True,
                                                     start=5.6))
    # pipelines: two micro-batch counts, key names as the contract has them and a slight variant
    _write(sweep / "3", "summary.json", fake_summary(
        "pipeline", 2, mesh={"pp": 2}, bubble={"measured": 0.24, "theory": 0.2, "per_stage": [0.2, 0.28],
                                               "n_microbatches": 4, "schedule": "1F1B"}))
    _write(sweep / "4", "summary.json", fake_summary(
        "pipeline", 2, mesh={"pp": 2}, bubble={"measured": 0.13, "theory": 0.111, "per_stage": [0.1, 0.16],
                                               "num_microbatches": 8, "schedule": "1F1B"}))
    # a run without throughput numbers (nulls are shown as "-")
    _write(sweep / "5", "summary.json", fake_summary("ddp", 4, step_time=None))
    # failed jobs: one from run.py's error.json, one unreadable summary
    _write(sweep / "6", "error.json", {"error": "data.global_batch_size=7 is not divisible by 2", "type": "ConfigError",
                                       "overrides": ["strategy=ddp", "data.global_batch_size=7"]})
    _write(sweep / "7", "summary.json", "{not json")
    (sweep / "multirun.yaml").write_text("hydra: {}\n")

    out = tmp_path / "report"
    proc = _run_report(sweep, out)
    assert proc.returncode == 0, proc.stderr
    assert "6 run(s), 2 failed job(s)" in proc.stdout
    md = (out / "report.md").read_text()
    for col in ("strategy", "world size", "mesh", "params", "precision", "global batch", "final loss", "step time",
                "samples/s", "tokens/s", "MFU", "model states per rank"):
        assert col in md, col
    runs = md[md.index("## Runs"):md.index("## Pipeline bubble")]
    rows = [ln for ln in runs.splitlines() if ln.startswith("| ") and not ln.startswith("| job")]
    assert len(rows) == 6, rows
    assert rows[0].split(" | ")[:3] == ["| 0", "single", "1"]
    assert "| ddp | 2 | dp_replicate=2 | 1.00M | 32-true | 32 | 3.3000 | 50.0 | 640 | 81,920 | 12.3% | 15.3 MiB x2 |" \
        in md
    assert "dp_shard=4" in md and "3.8 MiB x4" in md  # a quarter of the model states per rank
    assert "| 5 | ddp | 4 |" in md and "| - | - | - | - |" in md  # no step time, throughput, MFU
    failed = md[md.index("## Failed jobs"):]
    assert "`6`: ConfigError: data.global_batch_size=7 is not divisible by 2" in failed
    assert "`7`" in failed and "unreadable summary.json" in failed
    assert "## Pipeline bubble" in md and "1F1B" in md and "24.0%" in md
    _assert_pngs(out, ["memory.png", "speed.png", "loss.png", "bubble.png"])
    for png in ("memory.png", "speed.png", "loss.png", "bubble.png"):
        assert f"]({png})" in md
    # default output dir: the sweep dir itself
    assert _run_report(sweep).returncode == 0 and (sweep / "report.md").exists()


def test_plots_without_data_are_skipped(tmp_path):
    sweep = tmp_path / "sweep"
    s = fake_summary("single", 1, step_time=None)
    s["memory"] = []
    _write(sweep / "0", "summary.json", s)
    proc = _run_report(sweep)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in sweep.glob("*.png")) == ["loss.png"]
    md = (sweep / "report.md").read_text()
    assert "memory.png" not in md and "bubble" not in md.lower() and "None." in md  # no failed jobs

    empty = tmp_path / "empty"
    empty.mkdir()
    assert _run_report(empty).returncode == 1 and not (empty / "report.md").exists()
    assert _run_report(tmp_path / "missing").returncode == 2
    # the old command line still works
    old = _run_report(sweep, tmp_path / "old", entry=(str(ROOT / "experiments" / "report.py"),))
    assert old.returncode == 0 and (tmp_path / "old" / "report.md").exists(), old.stderr


def test_report_of_failed_jobs_only_builds_and_exits_0(tmp_path):
    sweep = tmp_path / "sweep"
    _write(sweep / "0", "error.json", {"error": "rank 0: UnpicklingError: bad shard", "type": "CheckpointException",
                                       "overrides": ["ckpt_path=/x"]})
    _write(sweep / "1", "error.json", {"error": "unknown strategy 'zer3'", "type": "ConfigError", "overrides": []})
    proc = _run_report(sweep)
    assert proc.returncode == 0, proc.stderr
    assert "0 run(s), 2 failed job(s)" in proc.stdout
    assert "failed: 0: CheckpointException: rank 0: UnpicklingError: bad shard" in proc.stdout
    md = (sweep / "report.md").read_text()
    assert "- `0`: CheckpointException: rank 0: UnpicklingError: bad shard  (overrides: `ckpt_path=/x`)" in md
    assert "- `1`: ConfigError: unknown strategy 'zer3'" in md and "## Runs" not in md


def test_a_plot_that_fails_does_not_lose_the_report(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    _write(sweep / "0", "summary.json", fake_summary("ddp", 2))

    def broken(runs, out):
        raise ValueError("cannot draw this")

    monkeypatch.setattr(report, "PLOTS", (("Broken", broken), *report.PLOTS))
    assert report.main([str(sweep)]) == 0
    assert "warning: plot not drawn: Broken: ValueError: cannot draw this" in capsys.readouterr().err
    md = (sweep / "report.md").read_text()
    assert "| 0 | ddp | 2 |" in md and "- not drawn: Broken: ValueError: cannot draw this" in md
    _assert_pngs(sweep, ["memory.png", "speed.png", "loss.png"])  # the other plots are still drawn


def test_bubble_keys_read_defensively():
    b = report.bubble_of({"bubble": {"measured": 0.3, "per_stage": [0.1, 0.2, 0.4], "microbatches": 6}})
    assert b["stages"] == 3 and b["microbatches"] == 6 and b["theory"] is None
    assert report.bubble_of({"bubble": {"measured": None}}) is None
    assert report.bubble_of({"bubble": None}) is None and report.bubble_of({}) is None
    b = report.bubble_of({"mesh": {"pp": 4, "dp": 2}, "bubble": {"theory": 0.5, "n_microbatches": 3}})
    assert b["stages"] == 4
    assert report.bubble_theory(4, 3) == pytest.approx(0.5)


@pytest.mark.slow
def test_report_of_real_compare_dp_sweep(tmp_path):
    """The compare_dp preset at one world size (2 jobs: single, ddp) on the tiny GPT, then the report."""
    sweep = tmp_path / "sweep"
    done = run_cli(["-m", "experiment=compare_dp", "hydra.sweeper.params.strategy='single,ddp'", "model=gpt_tiny",
                    "data.seq_len=64", "data.max_bytes=400000", "data.global_batch_size=8", "trainer.max_steps=12",
                    "trainer.devices=2", f"hydra.sweep.dir={sweep}"], sweep, timeout=400)
    # the sweep ends by naming its directory, what the report reads (issue 34: it never said where it was)
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith(f"sweep directory: {sweep}  (lightning-par-report {sweep}"), done.stdout[-1000:]
    summaries = [json.loads((sweep / j / "summary.json").read_text()) for j in ("0", "1")]
    assert [(s["strategy"], s["world_size"]) for s in summaries] == [("single", 1), ("ddp", 2)]
    assert_losses_match(summaries[1], summaries[0])
    proc = _run_report(sweep)
    assert proc.returncode == 0, proc.stderr
    assert "2 run(s), 0 failed job(s)" in proc.stdout
    md = (sweep / "report.md").read_text()
    assert "| 0 | single | 1 |" in md and "| 1 | ddp | 2 | dp_replicate=2 |" in md
    assert "strategy=single" in md and "strategy=ddp" in md  # sweep points
    _assert_pngs(sweep, ["memory.png", "speed.png", "loss.png"])
    assert not (sweep / "bubble.png").exists()


@pytest.mark.slow
def test_failed_jobs_do_not_stop_the_sweep(tmp_path):
    """4 jobs: two impossible global batches (ConfigError), one whose rank 1 is killed at step 3 (a
    failure of the run, not of its config: RankDied) and one good run. All are attempted, the good one
    keeps its summary, the others get error.json, the exit is nonzero. (A bad value such as
    trainer.max_steps=-5 is a config error now, checked before launch.)"""
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", *QUICK, "strategy=ddp", "trainer.devices=2", "data.global_batch_size=7,8",
                    "+callbacks.fault._target_=tests.fault.KillRankAt", "+callbacks.fault.step=1000,3",
                    f"hydra.sweep.dir={sweep}"], sweep, timeout=400, check=False)
    assert proc.returncode != 0, proc.stderr[-3000:]
    jobs = sorted((d for d in sweep.iterdir() if d.is_dir()), key=lambda d: int(d.name))
    assert len(jobs) == 4, proc.stderr[-3000:]
    results = {}
    for d in jobs:
        o = (d / ".hydra" / "overrides.yaml").read_text()
        key = ("7" if "global_batch_size=7" in o else "8", "3" if "fault.step=3" in o else "1000")
        results[key] = d
    good = json.loads((results["8", "1000"] / "summary.json").read_text())
    assert good["world_size"] == 2 and len(good["losses"]) == 12
    assert not (results["8", "1000"] / "error.json").exists()
    for key in (("7", "1000"), ("7", "3")):
        err = json.loads((results[key] / "error.json").read_text())
        assert err["type"] == "ConfigError" and "global_batch_size=7" in err["error"], err
        assert "\n" not in err["error"] and "data.global_batch_size=7" in err["overrides"]
        assert not (results[key] / "summary.json").exists()
    err = json.loads((results["8", "3"] / "error.json").read_text())
    assert err["type"] == "RankDied" and "rank 1 died" in err["error"], err
    assert "+callbacks.fault.step=3" in err["overrides"]

    rep = _run_report(sweep)
    assert rep.returncode == 0, rep.stderr
    md = (sweep / "report.md").read_text()
    assert "1 run(s) with a summary, 3 failed job(s)" in md
    failed = md[md.index("## Failed jobs"):]
    assert failed.count("ConfigError: data.global_batch_size=7") == 2 and "rank 1 died" in failed


@pytest.mark.slow
def test_single_run_config_error_exits_2(tmp_path):
    proc = run_cli([*QUICK, "strategy=ddp", "trainer.devices=2", "data.global_batch_size=7"], tmp_path, timeout=120,
                   check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "global_batch_size=7" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    err = json.loads((tmp_path / "error.json").read_text())
    assert err["type"] == "ConfigError" and "data.global_batch_size=7" in err["overrides"]


class FailLikeCheckpointSave:
    """A callback whose save fails the way torch.distributed.checkpoint fails: with its
    ``CheckpointException``, a BaseException (not an Exception) that wraps each rank's error."""

    def __new__(cls, fail: bool):
        import traceback

        import lightning as L
        from torch.distributed.checkpoint.api import CheckpointException

        class _Callback(L.Callback):
            def on_train_batch_end(self, trainer, *args):
                if fail and trainer.global_step == 2:
                    raise CheckpointException("save failed", {0: (OSError("No space left on device"),
                                                                  traceback.StackSummary())})

        return _Callback()


@pytest.mark.slow
def test_a_checkpoint_exception_fails_only_its_job(tmp_path):
    """Hydra's launcher records only Exceptions as failed jobs; a CheckpointException in job 0 must
    still leave error.json there and let job 1 run."""
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", *QUICK, "+callbacks.save._target_=tests.test_report.FailLikeCheckpointSave",
                    "+callbacks.save.fail=true,false", f"hydra.sweep.dir={sweep}"], sweep, timeout=300, check=False)
    assert proc.returncode != 0, proc.stderr[-3000:]
    err = json.loads((sweep / "0" / "error.json").read_text())
    assert err["type"] == "CheckpointException" and err["error"] == "rank 0: OSError: No space left on device", err
    assert "+callbacks.save.fail=True" in err["overrides"] and not (sweep / "0" / "summary.json").exists()
    assert json.loads((sweep / "1" / "summary.json").read_text())["steps"] == 12, proc.stderr[-3000:]
    assert "error: job 0: CheckpointException: rank 0: OSError: No space left on device" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("bad", [["data.global_batch_size=7"], ["strategy=zer3"]], ids=["in_job", "precheck"])
def test_torchrun_does_not_restart_a_config_error(tmp_path, bad):
    """torchrun --max-restarts=3 restarts the workers after any failure; a configuration error would fail
    every attempt the same way, so it must end the run at once: one attempt, a nonzero exit, error.json."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=3",
           "--monitor-interval=0.5", "-m", "lightning_par", *QUICK, "strategy=ddp", "trainer.devices=2", *bad,
           f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # a real command: the rank finds torchrun's agent by its parent's /proc/PID/cmdline (cli.stop_elastic_agent),
    # which for a forked program (tests/launch.py) is the fork server's
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert 1 <= len(errors) <= 2, log[-3000:]  # one attempt: at most one line per rank, not one per restart
    assert "will restart worker group" not in log, log[-3000:]
    if bad == ["strategy=zer3"]:  # refused before Hydra made a run directory
        assert errors[0].startswith("error: unknown strategy 'zer3'; choose from: ") and not run_dir.exists()
    else:
        assert "global_batch_size=7" in errors[0]
        err = json.loads((run_dir / "error.json").read_text())
        assert err["type"] == "ConfigError" and "data.global_batch_size=7" in err["overrides"], err
