"""torchrun: run.py works under it as the README writes it (the world is torchrun's ``WORLD_SIZE``,
not ``trainer.devices``), and with --max-restarts a killed rank is restarted, the run resumes from
its last checkpoint with the losses of an uninterrupted run, and the dead attempt's error.json is
gone once the run has finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lightning_par.run.train import latest_checkpoint
from tests.helpers import QUICK, ROOT, assert_losses_match

pytestmark = pytest.mark.slow


def torchrun(args: list[str], run_dir, restarts: int = 0, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={restarts}", "--monitor-interval=0.5", str(ROOT / "run.py"), *args,
           f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The README's command without faults: ddp at torchrun's 2 ranks, run once for both tests."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    proc = torchrun(QUICK + ["strategy=ddp"], run_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((run_dir / "summary.json").read_text())


def test_killed_rank_is_restarted_and_resumes_with_same_losses(tmp_path, uninterrupted):
    ref = uninterrupted
    run_dir = tmp_path / "elastic"
    run_dir.mkdir()
    (run_dir / "error.json").write_text('{"error": "a failed earlier attempt", "type": "RuntimeError"}')
    # the README's command: no trainer.devices, torchrun's --nproc-per-node decides
    proc = torchrun(QUICK + ["strategy=ddp", "callbacks=checkpoint",
                             "callbacks.checkpoint.every_n_train_steps=4", "ckpt_path=auto",
                             "+callbacks.fault._target_=tests.fault.KillRankAt", "+callbacks.fault.step=7",
                             "+callbacks.fault.rank=1"], run_dir, restarts=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert "exitcode: -9" in log, log[-3000:]  # torchrun saw the rank die of SIGKILL ...
    assert "step000004.ckpt" in log  # ... and the restarted ranks resumed from the step-4 checkpoint
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 12
    assert_losses_match(summary, ref)  # steps 1-4 restored from the checkpoint, 5-12 recomputed
    assert latest_checkpoint(str(run_dir / "checkpoints")).endswith("step000012.ckpt")
    assert not (run_dir / "error.json").exists()  # a failed attempt's record goes once the run has finished


def test_torchrun_without_faults(uninterrupted):
    summary = uninterrupted
    assert summary["world_size"] == 2 and summary["steps"] == 12
