"""The fork-server start of ranks 1..N-1 (strategies/fork_ranks.py) and the launcher's start of them,
in-process: exit codes read once under concurrent polls, a signal's exit as ``-signal``, and a rank that
cannot start ends the ranks already started. (What a forked rank inherits, and that it dies with its
launcher and survives a SIGTERM to the process group, is shown by real runs in test_faults.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from lightning_par.strategies.fork_ranks import ChildEntry, fork_context, fork_rank

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks fork from a fork server on Linux")


@pytest.mark.timeout(120)
def test_a_forked_ranks_exit_code_reads_the_same_from_every_thread():
    entry = ChildEntry("tests.fault", ("3",))
    rank = fork_rank(fork_context(entry), entry, dict(os.environ), None, "rank1")
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
    rank = fork_rank(fork_context(entry), entry, dict(os.environ), None, "rank1")
    with pytest.raises(subprocess.TimeoutExpired):
        rank.wait(0.2)
    rank.send_signal(signal.SIGKILL)
    assert rank.wait(30) == -signal.SIGKILL
    rank.kill()  # a second kill of an ended rank is a no-op


@pytest.mark.timeout(120)
def test_a_rank_that_cannot_start_ends_the_ranks_already_started(monkeypatch):
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_par.strategies import launcher

    for key in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)  # the launcher sets them in this process: restored after
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
    with pytest.raises(OSError, match="no process slots left"):
        starter._call_children_scripts()
    assert started[0].poll() == -signal.SIGKILL
