"""Helpers for end-to-end tests: run ``run.py`` in a subprocess with a time limit and read its summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# A run of a few seconds: tiny GPT, 12 steps, no validation, no progress bar.
QUICK = ["experiment=quick", "trainer.max_steps=12", "trainer.limit_val_batches=0",
         "trainer.enable_progress_bar=false"]


def run_cli(args: list[str], run_dir: Path, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    cmd = [sys.executable, str(ROOT / "run.py"), *args]
    if not any(a.startswith("-m") or a == "--multirun" for a in args):
        cmd.append(f"hydra.run.dir={run_dir}")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"run.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc


def train_summary(args: list[str], run_dir: Path, timeout: float = 240) -> dict:
    run_cli(args, run_dir, timeout)
    with open(run_dir / "summary.json") as f:
        return json.load(f)


def assert_losses_match(got: dict, ref: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    a, b = np.asarray(got["losses"]), np.asarray(ref["losses"])
    assert len(a) == len(b) >= 10, (len(a), len(b))
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol,
                               err_msg=f"{got['strategy']} x{got['world_size']} vs {ref['strategy']}")
