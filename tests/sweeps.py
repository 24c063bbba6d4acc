"""The shared multi-process runs of the end-to-end tests: ``run.py`` Hydra multiruns, each run once per
test session and read by every test module that needs it.

CPU time is the budget (two shared cores, ~15 s of process start-up per rank group), so runs are
grouped into Hydra multiruns (one parent process per sweep) and shared through ``sweep()``, a
per-session cache keyed by the argument list: ``test_e2e_sharded.py``, ``test_e2e_model_parallel.py``,
``test_comm.py``, ``test_checkpoint.py``, ``test_estimate_crosscheck.py``, ``test_compile.py``,
``test_moe.py`` and ``test_moe_costs.py`` read the same runs (the first test that needs one pays
for it). The cache is a directory shared by the session's xdist workers (``LP_SWEEP_DIR``, made by
``tests/conftest.py`` before the workers start): a sweep's directory is named by a hash of its arguments,
and a file lock per sweep makes the first worker that needs it run it while the other waits for it, so
each sweep still runs once per session while the modules that read them run on both workers.

Each sweep runs in its own process group with its output in a file: a timeout or a failure kills
every rank it started (an orphaned rank blocked in a collective cannot hang the suite). A sweep
that fails is never retried: torch's gloo exit race ("terminate called without an active
exception"), which an earlier version retried, is the product's to prevent (children end with
``os._exit``; the parent's process groups are destroyed and collected at exit, strategies/base.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from filelock import FileLock

from tests import launch
from tests.helpers import QUICK, ROOT


def _shared_dir() -> Path:
    """The session's sweep directory (``LP_SWEEP_DIR``; one of this process's own when run without the
    suite's conftest)."""
    if "LP_SWEEP_DIR" not in os.environ:
        os.environ["LP_SWEEP_DIR"] = tempfile.mkdtemp(prefix="lp_sweeps_")
    return Path(os.environ["LP_SWEEP_DIR"])


def _run_group(cmd: list[str], log: Path, timeout: float) -> int:
    """Run ``cmd`` in a session of its own, output to ``log`` (forked, ``tests/launch.py``); afterwards
    what is left of it is killed; -1: timed out."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    with open(log, "w") as f:
        try:
            return launch.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            return -1


def _files(args: tuple[str, ...]) -> tuple[str, Path, Path, Path, Path]:
    """A sweep's name (a hash of its arguments) and, in the session's directory, its sweep directory, log,
    and the markers of its end (done, failed: its exit status)."""
    shared = _shared_dir()
    name = "sweep_" + hashlib.sha256("\0".join(args).encode()).hexdigest()[:16]
    return (name, shared / name, shared / f"{name}.log", shared / f"{name}.done", shared / f"{name}.failed")


def sweep_dir(*args: str, timeout: float = 900) -> Path:
    """Run ``run.py -m QUICK *args`` once per test session; its sweep directory (jobs 0, 1, ...). A sweep
    that failed is not run again: every test reading it fails with its log. A sweep declared ``together``
    with others runs with them, the first time one of them is needed."""
    _run_together(tuple(args))
    shared = _shared_dir()
    name, out, log, done, failed = _files(args)
    with FileLock(str(shared / f"{name}.lock")):  # the other worker waits here while this one runs it
        if not done.exists() and not failed.exists():
            rc = _run_group([sys.executable, str(ROOT / "run.py"), "-m", *QUICK, *args, f"hydra.sweep.dir={out}"],
                            log, timeout)
            (done if rc == 0 else failed).write_text(str(rc))
        if failed.exists():
            rc = int(failed.read_text())
            raise AssertionError(f"run.py -m {' '.join(args)} failed ({'timeout' if rc == -1 else rc}):\n"
                                 f"{log.read_text()[-6000:]}")
    return out


#: sweep -> the sweeps declared together with it (``together``), until they have run
_TOGETHER: dict[tuple[str, ...], tuple[tuple[str, ...], ...]] = {}


def together(*sweeps: tuple[str, ...]) -> None:
    """Declare sweeps (each the arguments ``sweep`` takes) that run one after another in one process, as the
    jobs of one sweep run (``tests/serial.py``), when the first of them is needed: every sweep process starts
    the product's fork server of its ranks (a fresh interpreter importing torch, Lightning and transformers,
    ~5 s of CPU), and sweeps of different settings cannot be one multirun. A module declares the sweeps only it
    reads (a sweep several modules share may already run, or have run, on the other worker: then the
    process's sweeps would vary from session to session). Measured on 2 cores: test_e2e_sharded's 5 sweeps
    took 19 s in one process against 33 s as 5 processes."""
    group = tuple(tuple(a) for a in sweeps)
    for args in group:
        _TOGETHER[args] = group


def _run_together(args: tuple[str, ...]) -> None:
    """If ``args`` was declared ``together`` with other sweeps: run those of the group that have not run
    and that no other process is running now (their locks taken without waiting), one after another in one
    process, each with its own log and end marker as ``sweep_dir`` leaves them. A sweep that started but did
    not end (the process died or timed out) is marked failed, never run again; one that did not start is left
    to ``sweep_dir``."""
    from filelock import Timeout

    from tests import serial

    group = _TOGETHER.get(args)
    if group is None:
        return
    for member in group:
        _TOGETHER.pop(member, None)
    shared = _shared_dir()
    mine: dict[str, tuple[tuple[str, ...], Path, Path, Path, Path]] = {}
    locks = []
    try:
        for member in group:
            name, out, log, done, failed = _files(member)
            lock = FileLock(str(shared / f"{name}.lock"))
            try:
                lock.acquire(timeout=0)
            except Timeout:  # the other worker runs it now: sweep_dir waits for it there
                continue
            locks.append(lock)
            if not done.exists() and not failed.exists():
                mine[name] = (member, out, log, done, failed)
        if len(mine) < 2:  # nothing to share: sweep_dir runs it
            return
        jobs = {name: ["-m", *QUICK, *member, f"hydra.sweep.dir={out}"] for name, (member, out, *_) in mine.items()}
        ran = serial.run(jobs, shared / f"together_{os.getpid()}_{next(iter(mine))}", timeout=900 * len(mine),
                         logs={name: log for name, (_, _, log, _, _) in mine.items()})
        for name, job in ran.items():
            _, _, _, done, failed = mine[name]
            if job.started:
                (done if job.returncode == 0 else failed).write_text(str(-1 if job.returncode is None else job.returncode))
    finally:
        for lock in locks:
            lock.release()


def sweep(*args: str, timeout: float = 900) -> list[dict]:
    """The summaries of ``sweep_dir(*args)``'s jobs, in job order."""
    out = sweep_dir(*args, timeout=timeout)
    jobs = sorted((p for p in out.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    return [json.loads((p / "summary.json").read_text()) for p in jobs]


def by_strategy(summaries: list[dict]) -> dict[str, dict]:
    """A sweep's summaries by strategy name."""
    return {s["strategy"]: s for s in summaries}


# the shared runs (each a multirun; the first test that needs one pays for it)
def single_refs() -> tuple[dict, dict]:
    """Single-device references: plain, and with gradient clipping at 0.5."""
    plain, clipped = sweep("trainer.gradient_clip_val=null,0.5")
    return plain, clipped


# 4 ranks, saving a sharded checkpoint every 3 steps (test_checkpoint.py resumes from them)
FOUR_RANKS = ("strategy=ddp,zero1,zero2,zero3,fsdp,hsdp", "trainer.devices=4", "callbacks=checkpoint",
              "callbacks.checkpoint.every_n_train_steps=3")


def four_ranks() -> dict[str, dict]:
    return by_strategy(sweep(*FOUR_RANKS))


def two_ranks_accumulating() -> dict[str, dict]:
    """2 ranks x 2 accumulated micro-batches of 2 = the single run's global batch of 8, with
    activation checkpointing (recomputation does not change fp32 results: parity still holds)."""
    return by_strategy(sweep("strategy=ddp,zero1,zero2,zero3,fsdp,zero3_offload", "trainer.devices=2",
                             "trainer.accumulate_grad_batches=2", "strategy.activation_checkpointing=true"))


# Loss parity over a long horizon: one 2-rank sweep of 60 steps shared by the data-parallel strategies
# (test_e2e_sharded.py) and tensor_parallel/pipeline (test_e2e_model_parallel.py). It trains with SGD (momentum 0.9, lr
# 0.1, no clipping) because SGD passes a gradient's scale straight into the update: a gradient twice too
# large (a sum instead of a mean) moved the loss by 1.2e-3 at step 2 and 2e-2 at step 3 (measured),
# while AdamW normalises it away. Measured (gpt_tiny, fp32, gloo): the largest relative deviation from
# the single-device losses stays at 6e-8..1.5e-7 over all 60 steps for every strategy, without growth.
# Bound: rtol 1e-6 (about 7x the measurement, 1000x below a doubled gradient). Under AdamW the same
# rounding grows (about 1e-7 at steps 1-10, 2e-6..5e-6 at 21-60, 1e-5..3e-5 at 71-100), which is why
# the 12-step AdamW runs use rtol 1e-5 (docs/architecture.md).
LONG_STEPS = 60
LONG_PARITY = ("strategy=single,ddp,zero1,zero2,zero3,fsdp,tensor_parallel,pipeline", "trainer.devices=2",
               f"trainer.max_steps={LONG_STEPS}", "model.optimizer=sgd", "model.lr=0.1")


def long_parity() -> dict[str, dict]:
    return by_strategy(sweep(*LONG_PARITY))


def assert_parity_over_horizon(s: dict, ref: dict) -> None:
    got, want = np.asarray(s["losses"]), np.asarray(ref["losses"])
    assert len(got) == len(want) == LONG_STEPS, (len(got), len(want))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0,
                               err_msg=f"{s['strategy']} x{s['world_size']} vs single, steps 1-{LONG_STEPS}")


# MoE (test_moe.py, test_moe_costs.py): moe_tiny under SGD (momentum 0.9, lr 0.1; see test_moe.py), every
# run's losses equal to the single device's at rtol 1e-6
MOE_SGD = ("model=moe_tiny", "model.optimizer=sgd", "model.lr=0.1")
MOE_RTOL = 1e-6
MOE_STEPS = 12  # QUICK
# single (the reference) and ep=2 on 2 ranks, both saving a checkpoint every 2 steps
MOE_TWO = (*MOE_SGD, "strategy=single,expert_parallel", "trainer.devices=2", "callbacks=checkpoint",
           "callbacks.checkpoint.every_n_train_steps=2")


def moe_two() -> dict[str, dict]:
    return by_strategy(sweep(*MOE_TWO))


def assert_moe_parity(s: dict, ref: dict, first: int = 0) -> None:
    got, want = np.asarray(s["losses"])[first:], np.asarray(ref["losses"])[first:]
    assert len(s["losses"]) == len(ref["losses"]) == MOE_STEPS
    np.testing.assert_allclose(got, want, rtol=MOE_RTOL, atol=0,
                               err_msg=f"{s['strategy']} x{s['world_size']} mesh {s['mesh']} vs single")


def assert_moe_figures(s: dict, ref: dict, ep: int, first: int = 0) -> None:
    moe = s["moe"]
    # the same routing as the single device: the global tokens per expert of every step agree exactly
    assert moe["tokens_per_expert"] == ref["moe"]["tokens_per_expert"][first:]
    assert len(moe["tokens_per_expert"]) == MOE_STEPS - first and moe["dropped_fraction"] == 0.0
    assert all(b >= 1.0 for b in moe["load_balance_max_over_mean"])
    assert moe["all_to_all_bytes_per_step"] > 0 and ref["moe"]["all_to_all_bytes_per_step"] == 0
    assert s["mesh"].get("ep") == ep
