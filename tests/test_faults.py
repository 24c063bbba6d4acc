"""Fault injection: runs and sweeps fail safely.

- a rank killed mid-job fails only its job (error.json naming the rank); the sweep's next job trains;
- SIGTERM to a 2-rank ddp run stops every rank at one step with a checkpoint; ``ckpt_path=auto``
  resumes from it, finishes with an uninterrupted run's losses and clears the stale error.json;
- a non-finite loss stops the run (or warns), and summary.json stays strict JSON;
- a run directory held by a live run is refused in one line, a dead holder's lock is taken over,
  and child configs are unique per run;
- ``ckpt_path=auto`` picks the highest recorded step, not the digits of a file name;
- unwritable checkpoint directories and empty data files stop in one line before processes start.

The multi-process runs are shared between assertions (one sweep covers a killed-rank job and a good job).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from lightning_par import ConfigError
from lightning_par.callbacks.summary import json_safe
from lightning_par.data import TextDataModule
from lightning_par.core.jobs import LOCK_FILE, RunDirInUse, RunDirLock
from lightning_par.run.train import _write_child_config, latest_checkpoint
from tests.helpers import QUICK, ROOT, assert_losses_match, composed, run_cli

DDP2 = [*QUICK, "strategy=ddp", "trainer.devices=2"]


def strict_json(path: Path):
    """Parse as strict JSON: bare NaN/Infinity are errors."""
    def refuse(token: str):
        raise ValueError(f"{path} holds non-JSON constant {token}")
    return json.loads(path.read_text(), parse_constant=refuse)


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


# ----------------------------------------------------------------------------- a killed rank in a sweep
@pytest.fixture(scope="module")
def killed_rank_sweep(tmp_path_factory):
    """Job 0: rank 1 is SIGKILLed at step 7. Job 1: the same run without a fault (the fault step is
    past the end). Lightning's observer would have killed the whole sweep during job 1."""
    sweep = tmp_path_factory.mktemp("sweep")
    start = time.monotonic()
    proc = run_cli(["-m", *DDP2, "+callbacks.fault._target_=tests.fault.KillRankAt", "+callbacks.fault.step=7,1000",
                    "+callbacks.fault.rank=1", "+callbacks.probe._target_=tests.fault.RecordRankState",
                    f"hydra.sweep.dir={sweep}"], sweep, timeout=240, check=False,
                   fork=False)  # a real command: rank 0 must start as a command does, not forked
    return proc, sweep, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dead_rank_fails_only_its_job(killed_rank_sweep):
    proc, sweep, _ = killed_rank_sweep
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]  # a sweep with a failed job exits nonzero ...
    err = json.loads((sweep / "0" / "error.json").read_text())
    assert err["type"] == "RankDied" and "rank 1 died (killed (SIGKILL: out of memory, or sent by a person or a scheduler))" in err["error"], err
    assert not (sweep / "0" / "summary.json").exists()
    good = strict_json(sweep / "1" / "summary.json")  # ... but the next job ran to the end
    assert good["steps"] == 12 and good["world_size"] == 2, good
    assert not (sweep / "1" / "error.json").exists()
    # every job's children were started from a config file of their own
    assert len(list((sweep / "0" / ".hydra").glob("resolved-*.yaml"))) == 1


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks fork from a fork server on Linux")
def test_a_forked_rank_starts_as_a_started_one_would(killed_rank_sweep):
    """Rank 1 of a CPU job is forked from the launcher's fork server (core/fork_ranks.py), yet it
    begins as a fresh rank would: Lightning's rank-zero state is its own rank (the server imported Lightning
    as rank 0), SIGTERM is neither ignored nor blocked (the server blocks it), and multiprocessing's start
    method is rank 0's (the fork machinery set it to forkserver)."""
    _, sweep, _ = killed_rank_sweep
    for job in ("0", "1"):  # the second job's rank 1 is forked from the same server
        states = {r: json.loads((sweep / job / f"rank-state-{r}.json").read_text()) for r in (0, 1)}
        assert states[1]["forked"] and not states[0]["forked"], states
        for rank, state in states.items():
            assert state["env_rank"] == state["rank_zero_only"] == rank, states
            assert state["sigterm"] == str(signal.SIG_DFL) and not state["sigterm_blocked"], states
        assert states[1]["start_method"] == states[0]["start_method"] == "fork", states


class _SetupFails(L.Callback):
    def setup(self, *args: object, **kwargs: object) -> None:
        raise ValueError("this callback's setup failed")


def test_a_failure_before_the_model_is_materialised_is_the_error_reported(tmp_path):
    """A callback's setup raises while the model is still on the meta device: the run's error is the
    callback's, not the teardown's "Cannot copy out of meta tensor" (which error.json used to name)."""
    from lightning_par.run.train import train

    cfg = composed("experiment=quick", "trainer.max_steps=1", "trainer.enable_progress_bar=false",
                   "+callbacks.fails._target_=tests.test_faults._SetupFails", tmp=tmp_path)
    with pytest.raises(ValueError, match="this callback's setup failed"):
        train(cfg)


# ------------------------------------------------------------------------------------------- SIGTERM
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_stops_all_ranks_with_checkpoint_and_resumes(tmp_path, killed_rank_sweep):
    """SIGTERM to the run's whole process group, as a scheduler sends it: every rank stops at one agreed
    step (the fork server, in that group, blocks it: its death would kill the ranks before the stop)."""
    run_dir, marker = tmp_path / "run", tmp_path / "paused"
    args = [*DDP2, "callbacks=checkpoint", "callbacks.checkpoint.every_n_train_steps=4", "ckpt_path=auto"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    cmd = [sys.executable, str(ROOT / "run.py"), *args, f"hydra.run.dir={run_dir}",
           "+callbacks.pause._target_=tests.fault.PauseAt", "+callbacks.pause.step=5",
           f"+callbacks.pause.marker={marker}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), f"the run never reached step 5 (rc {proc.poll()})"
        assert int(marker.read_text()) == proc.pid  # rank 0 is the process we signal
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err[-3000:])
    assert took < 60, f"stopping took {took:.0f}s"
    assert "stopped: stopped by SIGTERM after step" in err, err[-3000:]
    assert not (run_dir / "summary.json").exists()
    record = json.loads((run_dir / "error.json").read_text())
    assert record["type"] == "RunStopped", record
    # the stop checkpoint: written after the signal (step 5), before the end, and the one auto picks
    ckpt = latest_checkpoint(str(run_dir / "checkpoints"))
    step = torch.load(Path(ckpt) / "meta.pt", weights_only=False)["global_step"]
    assert 5 < step < 12, (ckpt, step)
    assert ckpt in record["error"]

    resumed = run_cli(args, run_dir, timeout=240)  # ckpt_path=auto: continue from the stop checkpoint
    assert f"Restoring states from the checkpoint path at {ckpt}" in resumed.stdout + resumed.stderr
    summary = strict_json(run_dir / "summary.json")
    assert summary["steps"] == 12
    _, sweep, _ = killed_rank_sweep  # its job 1 is the same run without interruption
    assert_losses_match(summary, strict_json(sweep / "1" / "summary.json"))
    assert not (run_dir / "error.json").exists()  # the stopped attempt's record went with the success


# ------------------------------------------------------------------------------- a disk that fills
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_disk_filled_during_a_save_leaves_the_previous_checkpoint_to_resume(tmp_path, killed_rank_sweep):
    """2 ranks checkpoint every 4 steps; from step 8 every checkpoint write fails with ENOSPC part-way:
    the run stops in one line naming the directory, its free space and a checkpoint's size, the partial
    step-8 checkpoint is gone, and ``ckpt_path=auto`` resumes from step 4 to an uninterrupted run's losses."""
    run_dir = tmp_path / "run"
    args = [*DDP2, "callbacks=checkpoint", "callbacks.checkpoint.every_n_train_steps=4", "ckpt_path=auto"]
    proc = run_cli([*args, "+callbacks.fault._target_=tests.fault.FullDiskFrom", "+callbacks.fault.step=8"],
                   run_dir, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = lines[0]
    assert f"cannot save checkpoint {ckpts / 'step000008.ckpt'}" in line and "No space left on device" in line, line
    assert f"{ckpts} has " in line and " free; a checkpoint of this run takes " in line and "(step000004.ckpt)" in line
    assert sorted(p.name for p in ckpts.iterdir()) == ["step000004.ckpt"]  # the partial one is gone
    assert json.loads((run_dir / "error.json").read_text())["type"] == "CheckpointSaveError"
    log = (run_dir / "run.log").read_text()  # not a config mistake: its traceback is in run.log
    assert "rank 0 failed: CheckpointSaveError: " in log and "Traceback (most recent call last)" in log, log[-3000:]

    resumed = run_cli(args, run_dir, timeout=240)
    assert f"Restoring states from the checkpoint path at {ckpts / 'step000004.ckpt'}" in resumed.stdout + resumed.stderr
    _, sweep, _ = killed_rank_sweep  # its job 1 is the same run without interruption
    assert_losses_match(strict_json(run_dir / "summary.json"), strict_json(sweep / "1" / "summary.json"))


# --------------------------------------------------------------------------------------- non-finite loss
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_nonfinite_loss_stops_or_warns_and_summary_stays_json(tmp_path):
    # 2 ranks: both must stop at the same step, and the stop must not be blamed on a rank that "died"
    proc = run_cli(["-m", *DDP2, "model.lr=1e30", "callbacks.guard.nonfinite=stop,warn",
                    f"hydra.sweep.dir={tmp_path}"], tmp_path, timeout=200, check=False)
    assert proc.returncode != 0, proc.stderr[-3000:]
    stop, warn = tmp_path / "0", tmp_path / "1"
    err = json.loads((stop / "error.json").read_text())
    # the default cadence (a check every 10 steps) names the steps its check covered
    assert err["type"] == "NonFiniteLoss" and re.search(r"non-finite training loss \(NaN or inf\) at steps? \d",
                                                        err["error"]), err
    assert "\n" not in err["error"]
    assert not (stop / "summary.json").exists()
    summary = strict_json(warn / "summary.json")  # warn: the run finishes with a strict-JSON summary
    assert summary["steps"] == 12
    assert None in summary["losses"] and summary["final_loss"] is None, summary["losses"]
    assert "warning: non-finite training loss" in proc.stderr
    assert not (warn / "error.json").exists()


def test_an_unexpected_errors_traceback_goes_to_run_log_only(tmp_path):
    """The traceback of an error that is not a ConfigError goes to the job's run.log (the console and
    error.json keep one line, ``cli._job``): through rank 0's file handler of that file (Hydra's), not its
    console handler; a rank without one (started by the launcher) appends it to the file."""
    import io
    import logging

    from lightning_par.core.jobs import log_traceback

    def fail() -> None:
        raise RuntimeError("attempting to assign a gradient with device type 'cuda'\nto a tensor")

    try:
        fail()
    except RuntimeError as e:
        error = e
    root, console = logging.getLogger(), io.StringIO()
    handlers = [logging.FileHandler(tmp_path / "run.log"), logging.StreamHandler(console)]
    for h in handlers:
        root.addHandler(h)
    try:
        assert log_traceback(error, tmp_path) == tmp_path / "run.log"
    finally:
        for h in handlers:
            root.removeHandler(h)
            h.close()
    log = (tmp_path / "run.log").read_text()
    assert log.startswith("rank 0 failed: RuntimeError: attempting to assign a gradient with device type 'cuda' to a "
                          "tensor\nTraceback (most recent call last):"), log
    assert "in fail\n" in log and console.getvalue() == ""
    other = tmp_path / "rank1"
    other.mkdir()
    assert log_traceback(error, other) == other / "run.log"  # no handler of that file: appended
    log = (other / "run.log").read_text()
    assert log.startswith("rank 0 failed: RuntimeError: ") and "in fail\n" in log, log
    assert log_traceback(error, None) is None  # no job: nowhere to write


def test_json_safe_replaces_nonfinite_numbers():
    s = json_safe({"a": [1.0, float("nan")], "b": {"c": float("inf")}, "d": -float("inf"), "e": 2, "f": "x"})
    assert s == {"a": [1.0, None], "b": {"c": None}, "d": None, "e": 2, "f": "x"}
    json.dumps(s, allow_nan=False)


# ------------------------------------------------------------------------------------------ run directory
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_run_dir_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path):
    held = RunDirLock(tmp_path).acquire()
    with pytest.raises(RunDirInUse, match=rf"in use by another run \(pid {os.getpid()} on "):
        RunDirLock(tmp_path).acquire()
    held.release()
    RunDirLock(tmp_path).acquire().release()  # free again once released
    # a holder that dies without releasing (SIGKILL): its lock goes with it
    code = (f"import os, signal; from lightning_par.core.jobs import RunDirLock; RunDirLock({str(tmp_path)!r}).acquire(); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    dead = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60)
    assert dead.returncode == -signal.SIGKILL
    assert '"pid": ' in (tmp_path / LOCK_FILE).read_text()  # it did hold the lock, and left its record
    with RunDirLock(tmp_path) as lock:
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert lock.path == tmp_path / LOCK_FILE


def test_child_configs_are_unique_per_run(tmp_path):
    a = _write_child_config(OmegaConf.create({"run": 1}), str(tmp_path))
    b = _write_child_config(OmegaConf.create({"run": 2}), str(tmp_path))
    assert a != b
    assert OmegaConf.load(a).run == 1 and OmegaConf.load(b).run == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_second_live_run_into_a_run_dir_is_refused_in_one_line(tmp_path):
    theirs = {tmp_path / ".hydra" / "config.yaml": "the other run's config\n", tmp_path / "run.log": "its log\n"}
    for path, text in theirs.items():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    with RunDirLock(tmp_path):
        proc = run_cli([*DDP2], tmp_path, timeout=90, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and f"run directory {tmp_path} is in use by another run (pid {os.getpid()}" in lines[0]
    assert sorted(p.name for p in (tmp_path / ".hydra").iterdir()) == ["config.yaml"]  # no rank, no Hydra files
    assert {p: p.read_text() for p in theirs} == theirs  # the other run's files as they were
    assert not (tmp_path / "error.json").exists()  # and it leaves no record in the other run's directory


# ----------------------------------------------------------------------------------------- ckpt_path=auto
def _fake_checkpoint(path: Path, step: int | None, complete: bool = True) -> None:
    path.mkdir(parents=True)
    if step is not None:
        torch.save({"global_step": step, "epoch": 0}, path / "meta.pt")
    if complete:
        (path / ".metadata").write_bytes(b"")


def test_auto_resume_picks_the_highest_recorded_step(tmp_path):
    _fake_checkpoint(tmp_path / "step000009.ckpt", 9)
    _fake_checkpoint(tmp_path / "step000016-v1.ckpt", 16)  # its digits join to 161
    _fake_checkpoint(tmp_path / "step000015.ckpt", 15)
    _fake_checkpoint(tmp_path / "step000020.ckpt", 20, complete=False)  # shards still being written
    _fake_checkpoint(tmp_path / "step000030.ckpt", None)  # no meta.pt: not a complete checkpoint
    (tmp_path / "step000040.ckpt").mkdir()
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step000016-v1.ckpt")
    assert latest_checkpoint(str(tmp_path / "missing")) is None


# ---------------------------------------------------------------------------- checked before processes
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_unwritable_checkpoint_dir_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = run_cli([*DDP2, "callbacks=checkpoint", f"callbacks.checkpoint.dirpath={blocker}/ckpts"], tmp_path / "run",
                   timeout=90, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and f"checkpoint directory {blocker}/ckpts is not writable" in lines[0], proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_unwritable_run_and_sweep_directories_are_one_line(tmp_path):
    """A run directory no process may write (sysfs refuses new files even to root, so the case holds on
    CI's root too), one under a regular file, and a sweep directory under a regular file: one line each,
    exit 2, no Hydra traceback (was 34 lines)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cases = [([*QUICK], Path("/sys/kernel"), "run directory /sys/kernel cannot be created or written: Permission denied "
                                              "(/sys/kernel/.lightning_par.lock)"),
             ([*QUICK], blocker / "run", f"run directory {blocker / 'run'} cannot be created or written: Not a directory"),
             (["-m", *QUICK, f"hydra.sweep.dir={blocker / 'sweep'}"], None,
              f"sweep directory {blocker / 'sweep'} cannot be created or written: Not a directory")]
    for args, run_dir, expected in cases:
        env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="0")
        cmd = [sys.executable, str(ROOT / "run.py"), *args] + ([f"hydra.run.dir={run_dir}"] if run_dir else [])
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
        assert proc.returncode == 2, (args, proc.stderr[-3000:])
        assert error_lines(proc.stderr) == [f"error: {expected}; set hydra.run.dir (hydra.sweep.dir for -m) to a "
                                            "writable directory"], proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_empty_data_file_is_one_line_naming_it(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"")
    proc = run_cli([*DDP2, f"data.files={path}"], tmp_path / "run", timeout=90, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and f"data file {path} is empty" in lines[0], proc.stderr


def test_unreadable_data_file_is_named_when_the_data_is_configured(tmp_path):
    gone = tmp_path / "corpus.txt"
    gone.symlink_to(tmp_path / "deleted.txt")  # a dangling link: permissions would not stop root
    with pytest.raises(ConfigError, match=f"^cannot read data file {gone}: No such file or directory$"):
        TextDataModule(files=str(gone))
    ok = tmp_path / "ok"
    (ok / "sub").mkdir(parents=True)  # directories a pattern matches are not files to read
    (ok / "empty.txt").write_bytes(b"")
    (ok / "sub" / "text.txt").write_bytes(b"hello world")
    TextDataModule(files=str(ok / "**"))  # one empty file among readable ones is fine
    with pytest.raises(ConfigError, match=f"^data file {ok / 'empty.txt'} is empty$"):
        TextDataModule(files=str(ok / "empty.txt"))


# ------------------------------------------------------------------------------- orphaned children
_LAUNCH_AND_WAIT = """
import sys, time
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning_par.strategies.launcher import ChildCommandLauncher
launcher = ChildCommandLauncher(LightningEnvironment(), num_processes=2, num_nodes=1,
                                child_command=[sys.executable, "-c", "import time; time.sleep(120)"])
launcher._call_children_scripts()
print(launcher.procs[0].pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(120)
def test_children_die_with_a_killed_launching_process():
    parent = subprocess.Popen([sys.executable, "-c", _LAUNCH_AND_WAIT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()  # SIGKILL: no Python code runs in the parent, no reaper, no observer
        parent.wait(timeout=30)
        deadline = time.monotonic() + 20
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the child rank outlived its killed parent"
    finally:
        parent.kill()


def test_requeue_signal_runs_lightnings_slurm_requeue_then_stops():
    from types import SimpleNamespace

    from lightning_par.callbacks.guard import _REQUEUE, RunGuard, RunStopped

    calls = []
    trainer = SimpleNamespace(global_step=42, default_root_dir="/runs/7", is_global_zero=True,
                              _signal_connector=SimpleNamespace(_slurm_sigusr_handler_fn=lambda s, f: calls.append(s)))
    guard = RunGuard()
    guard._handler(_REQUEUE)(signal.SIGUSR1, None)  # what the installed handler does: only a flag
    assert calls == [] and guard._signal == _REQUEUE * 100 + signal.SIGUSR1
    guard._handler(1)(signal.SIGTERM, None)  # a stop signal after it: the requeue still wins the MAX
    with pytest.raises(RunStopped, match="requeued with Slurm after step 42"):
        guard._act_signal(trainer, guard._signal)
    assert calls == [signal.SIGUSR1]  # Lightning's handler: hpc checkpoint + scontrol requeue


_DEAD_BEFORE_RENDEZVOUS = """
import datetime, sys
from types import SimpleNamespace
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
import lightning_par.strategies.launcher as launcher_module
launcher_module._NOTICE_S = launcher_module._GIVE_UP_S = 2.0  # instead of 60 + 30 s
env = LightningEnvironment()
launcher = launcher_module.ChildCommandLauncher(env, num_processes=2, num_nodes=1,
                                                child_command=[sys.executable, "-c", "raise SystemExit(3)"])
def rendezvous():  # rank 0 waits for a rank 1 that is already dead
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{env.main_port}", rank=0, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
launcher.launch(rendezvous, trainer=SimpleNamespace(default_root_dir=sys.argv[1]))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rank_dead_before_rendezvous_is_recorded_instead_of_a_hang(tmp_path):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _DEAD_BEFORE_RENDEZVOUS, str(tmp_path)], cwd=ROOT, timeout=100,
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert time.monotonic() - start < 90  # not the rendezvous timeout (600 s here)
    err = json.loads((tmp_path / "error.json").read_text())
    assert err["type"] == "RankDied" and "rank 1 died (exit code 3) before the ranks connected" in err["error"], err
    assert error_lines(proc.stderr) == [f"error: {err['error']}"]


# --------------------------------------------------------------- whose error is the job's (no processes)
class _Child:
    """A stand-in for a child's Popen: ``poll()`` reads None until ``after`` calls, then ``code``."""

    def __init__(self, code, after: int = 0) -> None:
        self.code, self.after, self.returncode, self.pid = code, after, None, 0

    def poll(self):
        if self.after > 0:
            self.after -= 1
            return None
        self.returncode = self.code
        return self.code

    def kill(self) -> None:
        pass


@pytest.mark.parametrize(("child", "rank0_error", "dead"), [
    # both ranks raised their own error (a full disk), the child first: rank 0's error is the job's
    (_Child(1), OSError("disk tier: no room"), None),
    # rank 0's collective failed because the child exited: the child is the job's error ...
    (_Child(1), RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"), (1, 1)),
    # ... also when its exit shows only after rank 0 failed (a loaded machine)
    (_Child(1, after=5), RuntimeError("[gloo] Read error: Connection reset by peer"), (1, 1)),
    # a child killed by the kernel is the job's error whatever rank 0 saw
    (_Child(-9), ValueError("something else"), (1, -9)),
    # a healthy child: nothing to attribute
    (_Child(None), RuntimeError("gloo: Connection closed by peer"), None),
])
def test_a_dead_child_is_the_jobs_error_only_when_it_explains_rank_0s(child, rank0_error, dead):
    from lightning_par.strategies.launcher import ChildCommandLauncher, _is_peer_failure, _JobObserver

    observer = _JobObserver([child])
    ChildCommandLauncher._settle(observer, peer_failure=_is_peer_failure(rank0_error), wait_s=0.5)
    assert observer.dead == dead


# ------------------------------------------------------- the main process killed by the kernel (rank 0)
_KILL_ME = """
import os, signal, sys
from lightning_par.core.exit_watch import ExitWatch
watch = ExitWatch.get()
print(watch._proc.pid, flush=True)
watch.job_started(sys.argv[1], ["model=gpt_tiny"])
if sys.argv[2] == "end":
    watch.job_ended()
os.kill(os.getpid(), signal.SIGKILL)
"""


def _wait_gone(pid: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists(), f"watcher {pid} still running"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ended", [False, True])
def test_a_main_process_killed_mid_job_leaves_error_json(tmp_path, ended):
    """The watcher writes error.json when the process dies by SIGKILL inside a job, and only then."""
    proc = subprocess.run([sys.executable, "-c", _KILL_ME, str(tmp_path), "end" if ended else "open"], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    _wait_gone(int(proc.stdout.split()[0]))
    if ended:
        assert not (tmp_path / "error.json").exists()
        return
    err = json.loads((tmp_path / "error.json").read_text())
    assert err["type"] == "Killed" and err["rank"] == 0 and err["overrides"] == ["model=gpt_tiny"], err
    assert err["error"].startswith("rank 0 (the main process, pid ") and "SIGKILL" in err["error"], err
    assert "(SIGKILL: out of memory, or sent by a person or a scheduler)" in err["error"], err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_0_killed_by_the_kernel_is_recorded(tmp_path):
    """Rank 0 of a 2-rank run SIGKILLed at step 3 (as the OOM killer would): the job's error.json says
    so, no summary, and none of its descendants (rank 1, the fork server it came from) outlives it -- rank 1,
    asleep outside any collective at that step, ends with rank 0, not when it next reaches a collective."""
    run_dir, record = tmp_path / "run", tmp_path / "descendants.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    cmd = [sys.executable, str(ROOT / "run.py"), *DDP2, "+callbacks.fault._target_=tests.fault.KillRankAt",
           "+callbacks.fault.step=3", "+callbacks.fault.rank=0", f"+callbacks.fault.record={record}",
           "+callbacks.fault.others_pause_s=120",
           f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    # the output's pipes close when the last process holding them (rank 1, asleep) has ended
    assert time.time() - record.stat().st_mtime < 30, "rank 1 outlived rank 0 by more than 30 s"
    assert proc.returncode == -signal.SIGKILL, (proc.stdout + proc.stderr)[-3000:]
    deadline = time.monotonic() + 20
    while not (run_dir / "error.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    err = json.loads((run_dir / "error.json").read_text())
    assert err["type"] == "Killed" and "rank 0 (the main process" in err["error"] and "sent by a person or a scheduler" in err["error"]
    assert "trainer.devices=2" in err["overrides"], err
    assert not (run_dir / "summary.json").exists()
    left = json.loads(record.read_text())
    assert left, "rank 0 had no descendants: rank 1 was not among them"
    deadline = time.monotonic() + 20
    while (alive := [p for p in left if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"outlived rank 0: {[Path(f'/proc/{p}/cmdline').read_bytes()[:200] for p in alive]}"
