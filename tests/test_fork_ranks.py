"""The fork-server start of ranks 1..N-1 (core/fork_ranks.py) and the launcher's start of them,
in-process: exit codes read once under concurrent polls, a signal's exit as ``-signal``, and a rank that
cannot start ends the ranks already started. (What a forked rank inherits, and that it dies with its
launcher and survives a SIGTERM to the process group, is shown by real runs in test_faults.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

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
