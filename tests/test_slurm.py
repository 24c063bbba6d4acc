"""Real Slurm jobs on a one-node cluster on localhost (tests/slurm_cluster.py): a 2-task DDP run through
Hydra's submitit launcher (``hydra/launcher=slurm``) and through the plain ``scripts/slurm/train.sbatch``.
Under srun, Lightning's SLURMEnvironment gives the ranks; run.py starts no processes itself.

Skipped (with the reason) only where Slurm cannot be installed or started: not Linux, not root, no apt.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import QUICK, ROOT, assert_losses_match
from tests.slurm_cluster import SlurmCluster, SlurmUnavailable, start_cluster

# one xdist worker runs both tests: they share the session's one local Slurm cluster (and its munge daemon)
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("slurm")]

DDP2 = [*QUICK, "strategy=ddp", "trainer.devices=2"]


@pytest.fixture(scope="session")
def slurm() -> SlurmCluster:
    # not under pytest's tmp dir: slurmctld runs as user slurm and must reach its state/log dirs
    root = Path(tempfile.mkdtemp(prefix="lpar-slurm-"))
    try:
        cluster = start_cluster(root)
    except SlurmUnavailable as e:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"no local Slurm: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _env(cluster: SlurmCluster) -> dict[str, str]:
    return dict(cluster.env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0", PYTHON=sys.executable)


def _check_ddp2_summary(path: Path) -> dict:
    assert path.exists(), f"no {path}"
    s = json.loads(path.read_text())
    assert s["strategy"] == "ddp" and s["world_size"] == 2, (s["strategy"], s["world_size"])
    assert len(s["losses"]) >= 12 and s["steps"] == len(s["losses"])
    assert [m["rank"] for m in s["memory"]] == [0, 1]
    return s


def test_submitit_launcher_sweep(slurm, tmp_path):
    """Two sweep points = two Slurm jobs of 2 tasks each; the one with an impossible batch fails with
    error.json, the other trains to a summary, and the sweep exits nonzero."""
    import hydra_plugins.hydra_submitit_launcher  # noqa: F401 -- the plugin itself; missing, this test errors

    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(ROOT / "run.py"), "-m", "hydra/launcher=slurm", *DDP2, "data.global_batch_size=7,8",
           f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(slurm), capture_output=True, text=True, timeout=600)
    logs = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in sweep.glob(".submitit/*/*_log.*"))
    detail = f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}\n{logs[-8000:]}\n{slurm.logs(20)}"
    # one job failed, and it is the bad batch that failed it, not a launcher that could not start
    assert proc.returncode != 0 and "global_batch_size=7 is not divisible" in proc.stderr, detail
    jobs = {tuple(_overrides(d)): d for d in sweep.iterdir() if d.is_dir() and d.name.isdigit()}
    assert len(jobs) == 2, detail
    good = next(d for o, d in jobs.items() if "data.global_batch_size=8" in o)
    bad = next(d for o, d in jobs.items() if "data.global_batch_size=7" in o)
    s = _check_ddp2_summary(good / "summary.json")
    assert s["global_batch_size"] == 8
    err = json.loads((bad / "error.json").read_text())
    assert err["type"] == "ConfigError" and "global_batch_size=7" in err["error"], err
    assert "data.global_batch_size=7" in err["overrides"]
    assert not (bad / "summary.json").exists()
    # both ranks were started by srun and got their rank from Slurm
    rank_logs = "".join(p.read_text(errors="replace") for p in sweep.glob(".submitit/*/*_log.*"))
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in rank_logs, detail
    # submitit returns as soon as task 0 has written its result; the jobs then leave the queue
    assert slurm.wait_empty(timeout=120) == [], slurm.run(["squeue"], timeout=30).stdout


def _overrides(job_dir: Path) -> list[str]:
    import yaml

    return yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text())


def test_sbatch_script(slurm, tmp_path):
    run_dir = tmp_path / "run"
    job_id = slurm.sbatch([f"--output={tmp_path}/slurm-%j.out", str(ROOT / "scripts/slurm/train.sbatch"), *QUICK,
                           "strategy=ddp", f"hydra.run.dir={run_dir}"], env=_env(slurm), cwd=str(ROOT))
    state = slurm.wait_job(job_id, timeout=600)
    out = tmp_path / f"slurm-{job_id}.out"
    log = out.read_text(errors="replace") if out.exists() else "(no job output)"
    assert state == "COMPLETED", f"job {job_id}: {state}\n{log[-6000:]}\n{slurm.logs(20)}"
    assert "1 node(s) x 2 task(s)" in log
    s = _check_ddp2_summary(run_dir / "summary.json")
    assert s["global_batch_size"] == 8
    # the same run started by our own launcher gives the same losses (same seed, data order, global batch)
    local = tmp_path / "local"
    subprocess.run([sys.executable, str(ROOT / "run.py"), *DDP2, f"hydra.run.dir={local}"], cwd=ROOT,
                   env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300, check=True)
    assert_losses_match(s, json.loads((local / "summary.json").read_text()))
