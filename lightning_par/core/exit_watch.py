"""error.json for a main process that dies without running any code: the kernel's SIGKILL.

A job that fails in Python writes its own ``error.json`` (``jobs.record_failure``), and a rank the
kernel kills is reported by rank 0's launcher (``RankDied``). What neither can cover is the main
process itself -- a single-process run, or rank 0 of a job -- killed by the kernel's out-of-memory
killer: it runs no handler, so the run ended with a bare exit status 137 and nothing in its directory.

``ExitWatch`` starts one tiny process per main process (plain ``python -I -S``, no torch: a few MB)
that holds the read end of a pipe whose write end only the main process has. The main process
writes ``job <dir>`` when a job starts and ``end`` when it has finished -- normally or with its own
``error.json``. When the pipe reaches end-of-file (every way a process can end closes it) while a job
is open, the main process died without a word: the watcher reads how it died from ``/proc/<pid>/stat``
(``exit_code``, readable while the process is a zombie, until its parent reaps it) and writes the
job's ``error.json``: "rank 0 (the main process, pid N) was killed (SIGKILL: out of memory, or sent
by a person or a scheduler)". An ``error.json`` already written (``_JobObserver``'s last resort) is kept.

Why our own: torchrun's elastic agent records a rank's death by signal, but only for processes it
started; a plain ``python run.py`` (and the process the agent started, should the agent be the one
killed) has nobody watching. The watcher ignores SIGINT (Ctrl-C is the main process's to handle).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

#: the watcher: argv[1] = the watched pid. Standard library only (it starts with -I -S: no site-packages).
_WATCHER = r"""
import json, os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
pid = int(sys.argv[1])
job = None
for line in sys.stdin:
    kind, _, rest = line.rstrip("\n").partition(" ")
    job = json.loads(rest) if kind == "job" else None

def how_it_ended():
    # /proc/<pid>/stat field 52 is the wait status, readable while the dead process is a zombie
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            return None  # already reaped
        if fields[0] in ("Z", "X") and len(fields) > 49:
            return int(fields[49])
        time.sleep(0.02)
    return None

if job is not None:
    path = os.path.join(job["dir"], "error.json")
    if not os.path.exists(path):
        status = how_it_ended()
        sig = status & 0x7F if status is not None else None
        who = f"rank 0 (the main process, pid {pid})"
        if sig == signal.SIGKILL:
            error = f"{who} was killed (SIGKILL: out of memory, or sent by a person or a scheduler)"
        elif sig:
            error = f"{who} was killed by signal {signal.Signals(sig).name}"
        elif status is not None:
            error = f"{who} exited with code {(status >> 8) & 0xFF} without recording an error"
        else:
            error = f"{who} was killed without running its exit path (SIGKILL: out of memory, or sent by a person or a scheduler)"
        record = {"error": error, "type": "Killed", "overrides": job["overrides"], "rank": 0}
        tmp = os.path.join(job["dir"], f".error.json.{os.getpid()}")
        try:
            with open(tmp, "w") as f:
                f.write(json.dumps(record, indent=2) + "\n")
            os.replace(tmp, path)
        except OSError:
            pass
"""


class ExitWatch:
    """This process's watcher (one per process, started on the first job)."""

    _instance: ExitWatch | None = None

    def __init__(self) -> None:
        read_fd, self._fd = os.pipe()
        # the write end stays with this process alone: not inherited by the ranks it starts (Popen
        # closes fds; Python's pipes are close-on-exec), so its end-of-file is this process's end
        self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHER, str(os.getpid())], stdin=read_fd,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
        os.close(read_fd)

    @classmethod
    def get(cls) -> ExitWatch:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _send(self, line: str) -> None:
        try:
            os.write(self._fd, (line + "\n").encode())
        except OSError:  # the watcher is gone: nothing to report through
            pass

    def job_started(self, output_dir: str | os.PathLike, overrides: list[str]) -> None:
        self._send("job " + json.dumps({"dir": str(Path(output_dir).resolve()), "overrides": list(overrides)}))

    def job_ended(self) -> None:
        self._send("end")
