"""What a Hydra job leaves behind when it fails: ``error.json`` in its output directory.

The app's job function (``lightning_par/cli.py``) calls ``record_failure`` when a job raises. In a sweep (``-m``) the exception
is then handed back to Hydra, which marks the job failed, runs the remaining jobs, and ends the
sweep with a nonzero exit; ``lightning-par-report`` lists every ``error.json`` under the sweep
directory next to the summaries of the jobs that worked. A single run keeps its one-line error and
exit status 2 for configuration mistakes.

error.json: ``{"error": one-line message, "type": exception class name, "overrides": [the job's
command-line overrides], "rank": global rank that wrote it}``.

An unexpected error (not a ``ConfigError``) also leaves its traceback in the job's ``run.log``
(``log_traceback``), which the console line and error.json leave out.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lightning_par import ConfigError

ERROR_FILE = "error.json"
#: the job's log file (Hydra's job log: ``hydra.job.name`` is ``run``, ``conf/config.yaml``)
LOG_FILE = "run.log"
_RANK_ENV = ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK")


#: loggers of optional packages that warn at import about what a user cannot act on: torchao (imported by
#: transformers when installed) about CUDA kernels a CPU wheel lacks and, through torch's pytree, about
#: registering its enums
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_third_party_logs() -> None:
    """Only errors from ``QUIET_LOGGERS``: a command's first screen is ours, not import noise."""
    import logging

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def global_rank() -> int:
    """This process's global rank from the launcher's environment (0 when none is set)."""
    for key in _RANK_ENV:
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def root_error(exc: BaseException) -> BaseException:
    """The error worth reporting: Hydra's ``InstantiationException`` ("Error in call to target ...")
    is unwrapped to the exception the constructor raised."""
    seen = {id(exc)}
    while type(exc).__name__ == "InstantiationException" and exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def one_line(exc: BaseException, limit: int = 500) -> str:
    """The exception's message on one line (its lines joined, at most ``limit`` characters; the class
    name when there is no message)."""
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ == "CheckpointException" and isinstance(failures, dict) and failures:
        # torch.distributed.checkpoint's message is every failed rank's traceback; say what each rank hit
        parts = []
        for rank, failure in sorted(failures.items()):
            inner = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(inner).__name__}: {one_line(inner, limit)}")
        exc = Exception("; ".join(parts))
    line = " ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip()) or type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def hydra_job() -> dict[str, Any]:
    """The current Hydra job: output dir, overrides and whether it belongs to a multirun; empty
    outside Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return {}
        hc = HydraConfig.get()
        return {"output_dir": str(hc.runtime.output_dir), "overrides": [str(o) for o in hc.overrides.task],
                "multirun": hc.mode == RunMode.MULTIRUN, "num": hc.job.get("num")}
    except Exception:  # never let bookkeeping hide the real error
        return {}


def record_failure(exc: BaseException, output_dir: str | os.PathLike | None = None,
                   overrides: list[str] | None = None) -> Path | None:
    """Write ``error.json`` for a failed job (rank 0 writes it; other ranks only when rank 0 has
    not). Returns the path, or None when there is nowhere to write."""
    job = hydra_job()
    out = output_dir if output_dir is not None else job.get("output_dir")
    if out is None:
        return None
    if isinstance(root_error(exc), RunDirInUse):
        return None
    path = Path(out) / ERROR_FILE
    rank = global_rank()
    if rank != 0 and path.exists():
        return path
    exc = root_error(exc)
    record = {"error": one_line(exc), "type": type(exc).__name__,
              "overrides": list(overrides if overrides is not None else job.get("overrides", [])), "rank": rank}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{ERROR_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def log_traceback(exc: BaseException, output_dir: str | os.PathLike | None = None) -> Path | None:
    """Write the traceback of ``exc`` (an unexpected error: the console and error.json say it in one
    line) to the job's ``run.log`` only: through the root logger's file handler of that file where this
    process has one (rank 0, under Hydra's job logging), else appended to the file with this rank's number
    (a rank the launcher started). Returns the file, or None when there is nowhere to write."""
    import logging
    import traceback

    out = output_dir if output_dir is not None else hydra_job().get("output_dir")
    if out is None:
        return None
    path = Path(out) / LOG_FILE
    where = os.path.realpath(path)
    handlers = [h for h in logging.getLogger().handlers
                if isinstance(h, logging.FileHandler) and os.path.realpath(h.baseFilename) == where]
    rank = global_rank()
    if handlers:
        record = logging.getLogger(__name__).makeRecord(
            __name__, logging.ERROR, __file__, 0, "rank %d failed: %s: %s", (rank, type(exc).__name__, one_line(exc)),
            (type(exc), exc, exc.__traceback__))
        for h in handlers:
            if record.levelno >= h.level:
                h.handle(record)
        return path
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        with open(path, "a") as f:
            f.write(f"rank {rank} failed: {type(exc).__name__}: {one_line(exc)}\n{text}")
    except OSError:
        return None
    return path


def _rank_file(output_dir: str | os.PathLike, rank: int) -> Path:
    return Path(output_dir) / f".rank{rank}.{ERROR_FILE}"


def record_rank_failure(exc: BaseException, output_dir: str | os.PathLike | None) -> None:
    """A child rank's own error, for rank 0's launcher to report (``launcher._rank_failure``): one line,
    ``<type>: <message>``, in a hidden file of the run directory that the launcher reads and removes."""
    if output_dir is None:
        return
    exc = root_error(exc)
    try:
        _rank_file(output_dir, global_rank()).write_text(f"{type(exc).__name__}: {one_line(exc)}")
    except OSError:
        pass


def read_rank_failure(output_dir: str | os.PathLike, rank: int) -> str | None:
    """What ``record_rank_failure`` wrote for ``rank`` (and the file removed), or None."""
    path = _rank_file(output_dir, rank)
    try:
        line = path.read_text().strip()
        path.unlink()
    except OSError:
        return None
    return line or None


def clear_failure(output_dir: str | os.PathLike) -> None:
    """Remove a stale ``error.json`` (e.g. of a torchrun attempt that died before a restart finished
    the run): called once the run has succeeded."""
    try:
        (Path(output_dir) / ERROR_FILE).unlink()
    except FileNotFoundError:
        pass


# ----------------------------------------------------------------------------------- run directory
LOCK_FILE = ".lightning_par.lock"


class RunDirInUse(ConfigError):
    """Another live run holds the run directory (a one-line error before any process starts; the
    refused run writes no error.json there: the directory is the other run's)."""


class RunDirLock:
    """Exclusive claim of a run directory for the lifetime of one run.

    The lock is ``fcntl.flock`` on ``<run dir>/.lightning_par.lock``: the kernel grants it to one
    open file at a time and drops it when its holder exits, however it exits -- so a lock left by a
    dead process (SIGKILL, a crashed node's torchrun attempt) is simply taken over, with no
    pid-liveness guessing and no race between two runs that both find a stale file. The file's
    content (pid, host, start time) only serves the refusal message. The descriptor is not
    inherited by child processes (Python opens files close-on-exec).
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(os.path.abspath(run_dir)) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        import fcntl
        import socket
        import time

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirInUse(f"run directory {self.path.parent} is in use by another run ({holder}); "
                              "pick another hydra.run.dir or wait for it to finish") from None
        except OSError as e:  # a file system without locks: say so rather than run unprotected
            os.close(fd)
            raise RunDirInUse(f"cannot lock run directory {self.path.parent}: {e.strerror}") from None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        # the file stays: unlinking it would let a run that opened it just before acquire a dead inode
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None
        if _HELD.get(self.path) is self:
            del _HELD[self.path]

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


#: the run-directory locks this process holds, by lock-file path (``claim_run_dir``)
_HELD: dict[Path, RunDirLock] = {}


def claim_run_dir(run_dir: str | os.PathLike) -> RunDirLock:
    """This process's lock on ``run_dir``: the one it took already (the app claims the directory
    before Hydra writes into it, ``cli.ClaimRunDir``), else a new one. ``RunDirInUse`` when another
    live run holds it. ``release()`` gives it up."""
    path = Path(os.path.abspath(run_dir)) / LOCK_FILE
    if path not in _HELD:
        _HELD[path] = RunDirLock(path.parent).acquire()
    return _HELD[path]


def _read_holder(fd: int) -> str:
    try:
        rec = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {rec['pid']} on {rec['host']}, started {rec['started']}"
    except (OSError, ValueError, KeyError):
        return "holder unknown"
