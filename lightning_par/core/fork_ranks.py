"""Ranks 1..N-1 of a CPU job forked from a preloaded fork server instead of started as fresh interpreters.

A rank started as ``python -m lightning_par.run.child CONFIG`` imports torch, Lightning, transformers and
lightning_par again: 4-8 s of CPU each, which on a small machine is most of a short run (and of the test
suite). ``multiprocessing``'s ``forkserver`` start method keeps a server process per launching process
that imported those modules once; each rank is a fork of it, started in a fraction of a second, and every
job of a sweep after the first starts its ranks at once.

A fork carries the server's state, not a fresh interpreter's. What a rank must not keep, and where it
is undone (``_enter_rank``):

- the environment, working directory and ``sys.argv``: the rank's own are applied, as a command's would be
  (torch's thread count too, from the rank's ``OMP_NUM_THREADS``, which the server may have read before);
- Lightning's rank-zero state: ``rank_zero_only.rank`` was set from the environment when the server
  imported Lightning (rank 0 there), so rank 1 would log and write as rank 0 until the Trainer set it;
- the server blocks SIGTERM (below): the rank unblocks it, so that our run guard (or death) follows a
  scheduler's signal as it would in a command (one sent in between is delivered then);
- ``multiprocessing``'s start method, which the spawn machinery set to ``forkserver`` in the rank: reset to
  the platform's default, so a rank's DataLoader workers start as a command's would;
- the launching process's "alive" pipe to the server, which ``multiprocessing`` hands to every child (so it
  could fork siblings): while any rank held it the server would outlive a SIGKILLed launcher, and with it
  the ranks, which die with the server (``PR_SET_PDEATHSIG``). Closed.

The server itself blocks SIGTERM (``fork_server.py``, its first preload): a scheduler's SIGTERM to the
whole process group must reach the ranks, which stop together at an agreed step, and not kill the server,
whose death would kill every rank before that stop. It ends when the launching process ends (its alive
pipe closes). SIGINT it ignores already (``multiprocessing``'s own choice).

A rank does not import the launching script again as ``__mp_main__`` (what ``multiprocessing`` does for
starts other than fork; ``_main_not_reimported``): a user's script re-run on every rank (``how="script"``)
runs once in a rank, as ``__main__``, as Lightning's re-run of it would. A rank's stdin is /dev/null, and
it runs the ``atexit`` handlers its entry registered before it ends (``multiprocessing`` ends it with
``os._exit``).

The server starts with the launching process's environment at its first job (the app starts it as soon as
the config says the job forks, ``cli._prestart_fork_server``, so that its imports run beside rank 0's), so
what torch reads when it loads (``TORCH_CPP_LOG_LEVEL``) is fixed for the process's jobs; each rank's
environment is its own. Only the main thread starts a server (it dies with the thread that started it). One
fork server runs per process (``multiprocessing``'s): where one that this module did not start already runs
(started by other code for its own workers, with other preloads and signal handling), ranks start as
commands. Only CPU jobs on Linux fork (``launcher.ChildCommandLauncher``; ``PR_SET_PDEATHSIG``, which ends
the ranks with their launcher, is Linux's): forking is safe on a GPU machine only while nothing in the
server touched CUDA, which no GPU here has verified, so CUDA jobs start their ranks as commands.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

#: the pid of the fork server this module started (None: none yet); a server of other code is not reused
_ours: int | None = None
#: the environment variable that tells the server its launching process's pid (``fork_server.py``)
LAUNCHER_PID = "LIGHTNING_PAR_FORK_LAUNCHER"
#: the module a CPU job's ranks run (``python -m lightning_par.run.child CONFIG``), preloaded by the server
CHILD_MODULE = "lightning_par.run.child"


@dataclass(frozen=True)
class ChildEntry:
    """How ranks 1..N-1 of a job start. ``how="main"``: ``module.main(argv)``, as ``python -m module *argv``
    would (the app's ranks). A user's script that Lightning re-runs on every rank: ``how="script"``, the
    file ``module`` run as ``__main__`` with ``argv`` (``python FILE *argv``); ``how="module"``, the module
    run as ``__main__`` (``python -m module *argv``)."""

    module: str
    argv: tuple[str, ...]
    how: str = "main"

    def command(self) -> list[str]:
        head = [self.module] if self.how == "script" else ["-m", self.module]
        return [sys.executable, *head, *self.argv]

    def preload(self) -> list[str]:
        """What the server imports once for every rank: the app's child and its training code; for a
        user's script, the heavy modules its launching process imported (the script itself runs in each
        rank, as a re-run would: its top-level code is the user's, not the server's)."""
        if self.how == "main":
            return [self.module, "lightning_par.run.train"]
        return [m for m in ("torch", "lightning", "transformers", "lightning_par.strategies") if m in sys.modules]


def script_entry() -> ChildEntry:
    """This process's script as Lightning re-runs it on ranks 1..N-1 (its ``_basic_subprocess_cmd``)."""
    import __main__

    if __main__.__spec__ is None:
        return ChildEntry(os.path.abspath(sys.argv[0]), tuple(sys.argv[1:]), how="script")
    return ChildEntry(__main__.__spec__.name, tuple(sys.argv[1:]), how="module")


class ForkedRank:
    """A rank forked from the fork server, with the part of ``subprocess.Popen``'s interface that the
    launcher and Lightning's observer use (``pid``, ``poll``, ``returncode``, ``wait``, ``kill``,
    ``send_signal``); an exit by a signal reads as ``-signal``, as Popen's. ``poll`` is called from the
    observer's thread and the main thread: ``multiprocessing`` reads the exit code from a pipe once, and a
    second reader at the same moment would read 255, so the first code read is kept under a lock."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self._lock = threading.Lock()
        self._code: int | None = None

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        with self._lock:
            if self._code is None:
                self._code = self._process.exitcode
            return self._code

    def wait(self, timeout: float | None = None) -> int:
        from multiprocessing.connection import wait

        wait([self._process.sentinel], timeout)  # not join: it reads the exit code outside this lock
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"rank (pid {self.pid})", timeout or 0.0)
        return code

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class _InheritedFd:
    """A file descriptor of the launching process handed to a forked rank (sent to the server with the
    rank's arguments, as ``multiprocessing`` sends a pipe); in the rank, the descriptor's number there."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup: Any) -> int:
    return dup.detach()


def _enter_rank(entry: ChildEntry, env: dict[str, str], cwd: str | None, stdout: int, stderr: int,
                server_pid: int) -> None:
    """A forked rank's first code: undo what the fork carried over from the server (module docstring),
    then run the entry (``ChildEntry.how``)."""
    import atexit
    import importlib
    import multiprocessing
    import runpy
    import types
    from multiprocessing import forkserver

    from lightning.fabric.utilities.rank_zero import rank_zero_only

    die_with_parent()  # the server's death (it follows the launching process's) ends this rank ...
    if os.getppid() != server_pid:  # ... unless it died before that was set
        os._exit(1)
    alive = forkserver._forkserver._forkserver_alive_fd  # noqa: SLF001 -- multiprocessing has no API to drop it
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None  # noqa: SLF001
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one sent meanwhile is delivered now
    multiprocessing.set_start_method(None, force=True)  # the platform's default again
    for fd, target in ((stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    # the streams were made in the server, on /dev/null: buffered as a command's would be on this output
    sys.stdout.reconfigure(line_buffering=os.isatty(1), write_through=bool(env.get("PYTHONUNBUFFERED")))
    if cwd:
        os.chdir(cwd)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # the server's torch may have sized its pool already
        import torch

        torch.set_num_threads(int(threads))
    rank_zero_only.rank = int(env.get("RANK", env.get("LOCAL_RANK", "0")))
    sys.argv = [entry.module, *entry.argv]
    try:
        if entry.how == "main":
            importlib.import_module(entry.module).main(list(entry.argv))
        elif entry.how == "script":  # as ``python FILE`` (sys.path is the launcher's: the file's folder first);
            # the script's module stays ``__main__`` to the end (its atexit handlers may pickle its classes),
            # which runpy.run_path would not leave
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            main.__file__ = entry.module
            with open(entry.module, "rb") as f:
                code = compile(f.read(), entry.module, "exec")
            exec(code, main.__dict__)  # noqa: S102 -- the user's own script, as ``python FILE`` runs it
        else:  # as ``python -m module`` (runpy's own entry for it, which leaves the module as ``__main__``)
            sys.modules["__main__"] = types.ModuleType("__main__")  # runpy runs it in __main__'s namespace
            runpy._run_module_as_main(entry.module, alter_argv=True)  # noqa: SLF001
    finally:  # a multiprocessing child ends in os._exit: run what an interpreter's exit would
        atexit._run_exitfuncs()


def fork_context(entry: ChildEntry) -> Any:
    """The fork server's context, its modules preloaded; None where ranks start as commands instead (not
    Linux, or a fork server of other code runs in this process). The server starts once per launching
    process (again if it died) and gets no handle on this process's output (its ranks get theirs with their
    arguments): a reader of that output -- a shell's pipe, a test -- sees its end when the job's processes
    have ended, not when the server has."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    global _ours
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        # the server dies with the thread that started it (PR_SET_PDEATHSIG follows the thread): a fit in a
        # worker thread (a hyperparameter search's) starts its ranks as commands
        return None
    ctx = mp.get_context("forkserver")
    server = forkserver._forkserver  # noqa: SLF001 -- whether it runs already (the preload applies at its start)
    with server._lock:  # noqa: SLF001 -- multiprocessing's own, held while it reads or resets the server
        pid = server._forkserver_pid  # noqa: SLF001
        if pid is not None and pid != _ours:
            return None
        if pid is not None and _running(pid):
            return ctx
        if pid is not None:  # ours died (killed): forget it as multiprocessing would, and start a new one
            os.close(server._forkserver_alive_fd)  # noqa: SLF001
            server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None  # noqa: SLF001
    ctx.set_forkserver_preload(["lightning_par.core.fork_server", __name__, *entry.preload()])
    level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    # torch's C++ warnings carry a native stack of ~50 lines; a rank's are of a peer gone (rank 0 stopped or
    # failed, and says why in one line): errors only, unless the user set a level
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    sys.stdout.flush()
    sys.stderr.flush()
    devnull, saved = os.open(os.devnull, os.O_RDWR), (os.dup(1), os.dup(2))
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the server's parent, checked there (fork_server.py)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        server.ensure_running()
    finally:
        os.environ.pop(LAUNCHER_PID, None)
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (devnull, *saved):
            os.close(fd)
        if level is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
    _ours = server._forkserver_pid  # noqa: SLF001
    return ctx


def _running(pid: int) -> bool:
    """Whether our child ``pid`` still runs (a dead one is reaped here)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != pid
    except ChildProcessError:
        return False


_prep_lock = threading.Lock()


@contextmanager
def _main_not_reimported() -> Iterator[None]:
    """While a rank starts: multiprocessing's start data without the launching process's ``__main__``.

    multiprocessing would have the rank import the launching script as ``__mp_main__`` (for pickled
    objects of ``__main__``; a rank's arguments hold none), running its top-level code before the rank
    runs its entry: for a user's script without a ``__main__`` guard, the whole job once more, and then
    again as ``__main__`` (``how="script"``). A rank runs the script once, as Lightning's re-run does."""
    from multiprocessing import spawn

    starter = threading.get_ident()

    def without_main(name: str) -> dict:
        data = original(name)
        if threading.get_ident() == starter:  # another thread's start (while this one waits) is left alone
            for key in ("init_main_from_path", "init_main_from_name"):
                data.pop(key, None)
        return data

    with _prep_lock:
        original = spawn.get_preparation_data
        spawn.get_preparation_data = without_main
        try:
            yield
        finally:
            spawn.get_preparation_data = original


def fork_rank(entry: ChildEntry, env: dict[str, str], cwd: str | None, name: str) -> ForkedRank:
    """Start one rank from the server (``fork_context``: started again here if it died since the last rank)
    with its own environment and directory and this process's output."""
    import multiprocessing.process
    from multiprocessing import forkserver

    ctx = fork_context(entry)
    if ctx is None:  # a fork server of other code started meanwhile
        raise RuntimeError("the fork server of this process changed while ranks were starting")
    server_pid = forkserver._forkserver._forkserver_pid  # noqa: SLF001
    # not daemonic: a rank may start processes of its own (DataLoader workers)
    process = ctx.Process(target=_enter_rank, args=(entry, env, cwd, _InheritedFd(1), _InheritedFd(2), server_pid),
                          name=name, daemon=False)
    with _main_not_reimported():
        process.start()
    # multiprocessing polls its children's exit codes whenever it starts a process (``_cleanup``, e.g. for a
    # DataLoader worker of rank 0): the code is read from a pipe once, and ForkedRank reads it under a lock
    multiprocessing.process._children.discard(process)  # noqa: SLF001
    return ForkedRank(process)


def die_with_parent() -> None:
    """In a rank, before exec or as a forked rank's first act (Linux): SIGKILL this process when its parent
    (the launching process, or the fork server that follows it) dies, so a
    job whose main rank was killed outright (SIGKILL, the OOM killer, SIGTERM before training started)
    leaves no ranks waiting in a collective until the 30-minute timeout."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the observer and reaper still cover the usual paths
        pass
