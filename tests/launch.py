"""``subprocess.run`` for the tests' Python programs (``python run.py ...``, ``python SCRIPT``, ``python -m
MODULE``, ``python -c CODE``), each forked from a server that imported torch, Lightning, Hydra, transformers
and lightning_par once per pytest worker, instead of started as a fresh interpreter.

Why: a fresh interpreter spends 5-6 s of CPU importing those modules before the program does anything (a
config refused in one line took 5.7 s, a 12-step single-device run 7.1 s, on this 2-core machine), and the
suite starts a few hundred of them. A fork starts in a fraction of a second.

What the program sees is what a command gets, through the product's own forked-rank entry
(``lightning_par.core.fork_ranks._enter_rank``, which ranks 1..N-1 of every CPU job already run through):
its own environment, working directory, argv, output files and torch thread count; Lightning's rank-zero
state reset; SIGTERM unblocked and SIGINT at Python's default; ``multiprocessing``'s start method at the
platform's default. Here, in addition: a session of its own (so a timeout kills everything it started), the
first ``sys.path`` entry Python would give it, a fresh ``__main__``, and an uncaught exception printed and
ended through ``sys.excepthook`` with exit 1 as the interpreter does. The program's own fork server (a CPU job's ranks) starts fresh
in it, as in a command.

A console script of this environment (pip's wrapper, its first line ``#!`` and this interpreter) is forked
as the kernel would run it, ``python SCRIPT``: the wrapper and its entry point run, the interpreter does not
start. What a fork cannot show, and the tests that keep real commands for it: the interpreter's start and the
console scripts' (test_install, test_first_run), signals sent to a
process group or a shell's job (test_signals, test_faults), torchrun and Slurm (test_torchrun, test_report's torchrun restarts: a rank finds the agent by its
/proc cmdline; test_slurm),
and the product's own forking of commands (test_fork_ranks). Anything else that is not ``sys.executable``
with a file, ``-m`` or ``-c`` (another program, interpreter flags, ``input=``) runs through ``subprocess.run``.

The server is ``multiprocessing``'s fork server (one per process): tests/dist.py forks its ranks from the
same one (``context``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: what the server imports before it forks (those not installed are left out)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "lightning", "hydra", "omegaconf",
           "transformers", "lightning_par.core.fork_ranks", "lightning_par.parallel.parallelize",
           "lightning_par.strategies", "lightning_par.cli", "lightning_par.run.train", "lightning_par.run.child",
           "tests.dist", "tests.launch")


#: the environment the server started with: what the interpreter and torch read when they start
_started_with: dict[str, str] = {}


def context() -> Any:
    """The fork server's ``multiprocessing`` context (started with the preloads at its first use)."""
    import importlib.util
    import multiprocessing
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    server = forkserver._forkserver  # noqa: SLF001 -- whether it runs already (the preload applies at its start)
    if getattr(server, "_forkserver_pid", None) is None:
        _started_with.clear()
        _started_with.update(_read_at_start(os.environ))
        ctx.set_forkserver_preload([m for m in PRELOAD if importlib.util.find_spec(m.split(".")[0]) is not None])
        # the server must not hold this test's captured output (pytest's capture files) for the session
        sys.stdout.flush()
        sys.stderr.flush()
        devnull, saved = os.open(os.devnull, os.O_RDWR), (os.dup(1), os.dup(2))
        try:
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            server.ensure_running()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in (devnull, *saved):
                os.close(fd)
    return ctx


def _read_at_start(env: dict) -> dict[str, str]:
    """The variables the interpreter reads when it starts (PYTHONPATH, ...) and torch when it loads
    (TORCH_LOGS, TORCH_CPP_LOG_LEVEL, ...): a program whose differ from the server's starts as a command
    (PYTHONPATH: unless ``_same_preloads``).
    PYTHONUNBUFFERED is applied to a fork's streams, OMP_NUM_THREADS to torch's pool (the product's rank
    entry); Lightning's (PL_GLOBAL_SEED, set by seed_everything in a test's own process) and inductor's
    (TORCHINDUCTOR_*) are read when used."""
    return {k: v for k, v in env.items() if k.startswith(("PYTHON", "TORCH_")) and k != "PYTHONUNBUFFERED"}


def _through_interpreter(cmd: list[str], env: dict | None) -> list[str]:
    """A script whose first line is ``#!`` and this interpreter (pip's console scripts, ``lightning-par``;
    a bare name found on the program's ``PATH``) as the kernel runs it: ``[sys.executable, SCRIPT, *args]``
    -- then forked like any ``python SCRIPT``."""
    import shutil

    if not cmd or cmd[0] == sys.executable:
        return cmd
    script = cmd[0] if os.sep in cmd[0] else shutil.which(cmd[0], path=(os.environ if env is None else env).get("PATH"))
    if script is None or not os.path.isfile(script):
        return cmd
    with open(script, "rb") as f:
        first = f.readline(4096)
    if first.rstrip(b"\r\n") != b"#!" + os.fsencode(sys.executable):
        return cmd
    return [sys.executable, script, *cmd[1:]]


def _forkable(cmd: list[str], kwargs: dict) -> bool:
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return False
    if len(cmd) < 2 or str(cmd[0]) != sys.executable or set(kwargs) - _SUPPORTED:
        return False
    first = str(cmd[1])
    if first not in ("-c", "-m") and first.startswith("-"):
        return False
    context()
    wanted = _read_at_start(os.environ if kwargs.get("env") is None else kwargs["env"])
    if not _same_preloads(wanted.pop("PYTHONPATH", ""), _started_with.get("PYTHONPATH", "")):
        return False
    return wanted == {k: v for k, v in _started_with.items() if k != "PYTHONPATH"}


def _same_preloads(path: str, server_path: str) -> bool:
    """Whether a program's ``PYTHONPATH`` lets it fork: every entry the server's lacks (the tests give the
    repository, for a script that imports ``tests``) holds none of the preloaded packages, or the very files
    the server imported -- so the program imports what it would as a command. ``main`` puts the entries on
    its ``sys.path`` where the interpreter would."""
    import importlib.util

    tops = {m.split(".")[0] for m in PRELOAD}
    for entry in (e for e in path.split(os.pathsep) if e and e not in server_path.split(os.pathsep)):
        for top in tops:
            here = [p for p in (Path(entry) / top / "__init__.py", Path(entry) / f"{top}.py") if p.exists()]
            if not here:
                continue
            spec = importlib.util.find_spec(top)
            if spec is None or spec.origin is None or Path(spec.origin).resolve() != here[0].resolve():
                return False
    return True


_SUPPORTED = {"cwd", "env", "timeout", "capture_output", "text", "stdout", "stderr", "start_new_session", "check"}


def run(cmd: list, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, **kwargs)``, forked from the server where ``cmd`` is a Python program (module
    docstring). Supported: ``cwd``, ``env``, ``timeout``, ``capture_output``, ``text``, ``stdout``/``stderr``
    (an open file, or ``subprocess.STDOUT`` for stderr), ``check``, ``start_new_session`` (then what the
    program left running is killed when it ends). The program always runs in a session of its own, which is
    killed whole on a timeout."""
    cmd = _through_interpreter([str(c) for c in cmd], kwargs.get("env"))
    if not _forkable(cmd, kwargs):
        return subprocess.run(cmd, **kwargs)
    from lightning_par.core.fork_ranks import ChildEntry, ForkedRank, _InheritedFd, _main_not_reimported

    timeout = kwargs.get("timeout")
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    cwd = os.fspath(kwargs.get("cwd") or os.getcwd())
    capture = kwargs.get("capture_output", False)
    with tempfile.TemporaryDirectory(prefix="lp_launch_") as tmp:
        files = []
        for name, given in (("stdout", kwargs.get("stdout")), ("stderr", kwargs.get("stderr"))):
            if capture or given == subprocess.PIPE:
                files.append(open(Path(tmp) / name, "w+b"))  # noqa: SIM115 -- closed below
            elif given == subprocess.STDOUT:
                files.append(files[0])
            else:  # None: this process's own output, as a command's
                files.append(given)
        fds = [f.fileno() if f is not None else 1 if i == 0 or kwargs.get("stderr") == subprocess.STDOUT else 2
               for i, f in enumerate(files)]
        ctx = context()
        from multiprocessing import forkserver

        server_pid = forkserver._forkserver._forkserver_pid  # noqa: SLF001
        entry = ChildEntry(__name__, tuple(cmd[1:]))
        process = ctx.Process(target=_launched, args=(entry, env, cwd, _InheritedFd(fds[0]), _InheritedFd(fds[1]),
                                                      server_pid), name="launched", daemon=False)
        with _main_not_reimported():  # not this process's __main__ (pytest's, a script's) imported first
            process.start()
        child = ForkedRank(process)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        if code is None or kwargs.get("start_new_session"):  # what it left running (its ranks, its fork server)
            _kill_group(child.pid)
        if code is None:
            child.wait(30)
        out = [_read(f, kwargs.get("text")) if capture or kwargs.get(n) == subprocess.PIPE else None
               for f, n in zip(files, ("stdout", "stderr"))]
        if kwargs.get("stderr") == subprocess.STDOUT:
            out[1] = None
        for f in {id(f): f for f in files if f is not None}.values():
            if kwargs.get("stdout") is not f and kwargs.get("stderr") is not f:
                f.close()
    if code is None:
        raise subprocess.TimeoutExpired(cmd, timeout, output=out[0], stderr=out[1])
    done = subprocess.CompletedProcess(cmd, code, out[0], out[1])
    if kwargs.get("check"):
        done.check_returncode()
    return done


def _read(f: Any, text: bool | None) -> str | bytes:
    f.seek(0)
    data = f.read()
    return data.decode(errors="replace") if text else data


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _launched(entry: Any, env: dict, cwd: str, stdout: Any, stderr: Any, server_pid: int) -> None:
    """In the forked program: a session of its own, then the product's rank entry (which runs ``main``)."""
    from lightning_par.core.fork_ranks import _enter_rank

    os.setsid()
    _enter_rank(entry, env, cwd, stdout, stderr, server_pid)


def _path_starts_with(first: str) -> None:
    """``sys.path`` as the interpreter starts it: ``first`` (the script's folder, the working directory,
    ``''``), then ``PYTHONPATH``'s entries (``_same_preloads``), then the rest (the server's)."""
    sys.path[0] = first
    sys.path[1:1] = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e and e not in sys.path[1:]]


def main(argv: list[str]) -> None:
    """Run ``python *argv`` in this (forked) process, as the interpreter would: ``-c CODE``, ``-m MODULE`` or
    ``FILE``, with the arguments after it."""
    import runpy

    try:
        if argv[0] == "-m":  # python -m: the working directory first on the path; runpy's own entry
            _path_starts_with(os.getcwd())
            sys.argv = list(argv[1:])
            sys.modules["__main__"] = types.ModuleType("__main__")
            runpy._run_module_as_main(argv[1], alter_argv=True)  # noqa: SLF001
            return
        module = sys.modules["__main__"] = types.ModuleType("__main__")
        module.__builtins__ = __builtins__
        if argv[0] == "-c":  # python -c: '' first on the path, argv[0] '-c'
            _path_starts_with("")
            sys.argv = ["-c", *argv[2:]]
            source, filename = argv[1], "<string>"
        else:  # python FILE: the file's folder first on the path
            _path_starts_with(os.path.dirname(os.path.abspath(argv[0])))
            sys.argv = list(argv)
            with open(argv[0], "rb") as f:
                source = f.read()
            filename = argv[0]
            module.__file__ = os.path.abspath(argv[0])  # as Python 3.9+ sets a script's __file__
        exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 -- the test's own program
    except SystemExit:
        raise
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # the interpreter ends by the signal
    except BaseException:  # noqa: BLE001 -- the interpreter's way: sys.excepthook (the product installs one), exit 1
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
        raise SystemExit(1) from None
