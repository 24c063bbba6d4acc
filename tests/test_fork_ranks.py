"""The fork-server start of ranks 1..N-1 (core/fork_ranks.py) and the launcher's start of them,
in-process: exit codes read once under concurrent polls, a signal's exit as ``-signal``, and a rank that
cannot start ends the ranks already started. (What a forked rank inherits, and that it dies with its
launcher and survives a SIGTERM to the process group, is shown by real runs in test_faults.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lightning_par.core.fork_ranks import ChildEntry, fork_context, fork_rank

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks fork from a fork server on Linux")


def _stop_server() -> None:
    """Stop this process's fork server, whoever started it (tests/dist.py starts one in pytest workers)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    with server._lock:
        if server._forkserver_pid is not None:
            os.kill(server._forkserver_pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(server._forkserver_pid, 0)
            os.close(server._forkserver_alive_fd)
            server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None


@pytest.fixture(autouse=True, scope="module")
def _own_server():
    """The module's tests start the launcher's server; the next module gets a fresh one of its own."""
    _stop_server()
    yield
    _stop_server()


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln for ln in f if ln.startswith(field + ":")).split()[1], 16)


@pytest.mark.timeout(120)
def test_a_forked_ranks_exit_code_reads_the_same_from_every_thread():
    entry = ChildEntry("tests.fault", ("3",))
    rank = fork_rank(entry, dict(os.environ), None, "rank1")
    codes: list[int | None] = []

    def poll_until_done() -> None:
        while (code := rank.poll()) is None:
            pass
        codes.append(code)

    threads = [threading.Thread(target=poll_until_done) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert codes == [3] * 8 and rank.wait(10) == 3 and rank.returncode == 3


@pytest.mark.timeout(120)
def test_a_forked_rank_killed_by_a_signal_reads_as_popen_would():
    entry = ChildEntry("tests.fault", ("sleep",))
    rank = fork_rank(entry, dict(os.environ), None, "rank1")
    with pytest.raises(subprocess.TimeoutExpired):
        rank.wait(0.2)
    rank.send_signal(signal.SIGKILL)
    assert rank.wait(30) == -signal.SIGKILL
    rank.kill()  # a second kill of an ended rank is a no-op


@pytest.mark.timeout(120)
def test_a_rank_that_cannot_start_ends_the_ranks_already_started(monkeypatch):
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_par.strategies import launcher

    started: list[subprocess.Popen] = []
    real = subprocess.Popen

    def second_fails(*args, **kwargs):
        if started:
            raise OSError("no process slots left")
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(launcher.subprocess, "Popen", second_fails)
    starter = launcher.ChildCommandLauncher(LightningEnvironment(), num_processes=3, num_nodes=1,
                                            child_command=[sys.executable, "-c", "import time; time.sleep(60)"])
    saved = dict(os.environ)  # the launcher sets MASTER_PORT, WORLD_SIZE, ... in this process
    try:
        with pytest.raises(OSError, match="no process slots left"):
            starter._call_children_scripts()
    finally:  # else every later run started from this worker believes it is a rank of a 3-process job
        os.environ.clear()
        os.environ.update(saved)
    assert started[0].poll() == -signal.SIGKILL


@pytest.mark.timeout(120)
def test_a_dead_fork_server_is_started_again_as_the_first_was():
    """The server killed (by a person, the OOM killer): the next job starts a new one -- blocking SIGTERM,
    without this process's output -- and its ranks run. A fork server of other code is never used."""
    import multiprocessing
    from multiprocessing import forkserver

    entry = ChildEntry("tests.fault", ("0",))
    assert fork_rank(entry, dict(os.environ), None, "rank1").wait(30) == 0
    old = forkserver._forkserver._forkserver_pid
    os.kill(old, signal.SIGKILL)
    os.waitpid(old, 0)  # dead and reaped (fork_context also finds a dead one not yet reaped)
    assert fork_rank(entry, dict(os.environ), None, "rank1").wait(30) == 0  # from a server started again
    new = forkserver._forkserver._forkserver_pid
    assert new not in (None, old)
    assert _status(new, "SigBlk") & (1 << (signal.SIGTERM - 1)), "the new server does not block SIGTERM"

    _stop_server()
    multiprocessing.get_context("forkserver").set_forkserver_preload(["os"])
    forkserver.ensure_running()  # as tools/prepare.py or tests/dist.py start one for their own workers
    assert fork_context(entry) is None  # not ours: ranks start as commands


USER_SCRIPT = '''
import atexit, json, multiprocessing, os, sys
from pathlib import Path
import torch
import lightning as L
from torch.utils.data import DataLoader, TensorDataset
import lightning_par.strategies  # registers lp_ddp

out = Path(sys.argv[1])
# no __main__ guard: what a re-run runs is the whole file, once per rank
rank = int(os.environ.get("LOCAL_RANK", "0"))
with open(out / f"top-level-{rank}", "a") as f:
    f.write(f"{os.getpid()} {__name__}\\n")
atexit.register(lambda: (out / f"atexit-{rank}").write_text("ran"))


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Record(L.Callback):
    def on_train_end(self, trainer, module):
        state = {"forked": multiprocessing.parent_process() is not None, "argv": sys.argv[1:],
                 "file": __file__, "steps": trainer.global_step, "rank": trainer.global_rank}
        (out / f"state-{trainer.global_rank}.json").write_text(json.dumps(state))


torch.manual_seed(0)
data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
trainer = L.Trainer(strategy="lp_ddp", devices=2, accelerator="cpu", max_steps=3, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[Record()])
trainer.fit(Net(), DataLoader(data, batch_size=4))
if rank == 1:  # work of its own after the last collective: rank 0's process ends first and must wait for it
    import time
    time.sleep(2.0)
    (out / "after-fit-1").write_text("done")
'''


@pytest.mark.timeout(180)
def test_a_users_script_is_re_run_on_a_forked_rank_once_as_main(tmp_path):
    """A user's script with ``Trainer(strategy="lp_ddp", devices=2, accelerator="cpu")`` (Lightning re-runs
    it on rank 1): rank 1 is a fork of the fork server, runs the script's top level once, as ``__main__``
    with the same arguments and file (no ``__mp_main__`` import of it first), trains, and runs the script's
    ``atexit`` handlers as an interpreter's exit would; rank 0's process, which ends first, waits for rank 1
    to finish what it does after the last collective (a forked rank dies with the launching process)."""
    script = tmp_path / "user_train.py"
    script.write_text(USER_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), "--an-argument"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    states = {r: json.loads((tmp_path / f"state-{r}.json").read_text()) for r in (0, 1)}
    assert states[1]["forked"] and not states[0]["forked"], states
    for r, state in states.items():
        assert state["steps"] == 3 and state["rank"] == r, states
        assert state["argv"] == [str(tmp_path), "--an-argument"] and state["file"] == str(script), states
        runs = (tmp_path / f"top-level-{r}").read_text().splitlines()
        assert len(runs) == 1 and runs[0].endswith(" __main__"), (r, runs)
        assert (tmp_path / f"atexit-{r}").read_text() == "ran"
    assert (tmp_path / "after-fit-1").read_text() == "done"  # rank 0's exit waited for rank 1's own end


def _can_be_pid_1() -> bool:
    import shutil

    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-pf", "--mount-proc", sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, timeout=30)
    return probe.returncode == 0 and probe.stdout.strip() == "1"


@pytest.mark.timeout(180)
def test_a_launcher_that_is_pid_1_forks_its_ranks(tmp_path):
    """In a container without an init process the launching process is pid 1: the fork server, whose
    parent it is, must not take that for its launcher having died (it checked ``getppid() == 1``)."""
    if not _can_be_pid_1():
        pytest.skip("needs unshare -pf (a new pid namespace), which this machine does not allow")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["unshare", "-pf", "--mount-proc", sys.executable, str(root / "run.py"), "experiment=quick",
                           "strategy=ddp", "trainer.devices=2", "trainer.max_steps=2", f"hydra.run.dir={tmp_path}"],
                          cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 2, summary
