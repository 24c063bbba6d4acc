"""Several of the app's commands run one after another in one process, as the jobs of a Hydra sweep run.

Why: every multi-rank command starts the product's fork server of its CPU ranks (``core/fork_ranks.py``), a
fresh interpreter that imports torch, Lightning and transformers: 4-6 s of CPU before the command's ranks
start, on top of what the command itself does. A sweep's jobs share one server (docs/operations.md, Sweeps);
commands that differ in more than one swept key cannot be one sweep, but they can share the process the same
way: ``run`` runs each command's script (``run.py``, or a console script such as ``lightning-par``) as
``python SCRIPT ARGS`` runs it -- ``sys.argv`` set, the script run as ``__main__`` --, one after another in one
process forked from the tests' server (``tests/launch.py``). Measured on this 2-core machine: the 13 runs of
test_e2e_model_parallel (2-8 ranks, 12 steps each) took 50 s in one process against 91 s as 13 commands; the
advisor's 13 scaled-down commands 55 s against 95 s; test_catalog's five commands (a fresh interpreter: their
PYTHONPATH names a copy of the package) 45 s against 79 s.

What a command gets is what it gets as a command, save the process: its arguments, its output in files of its
own (``Job.stdout``, ``Job.stderr``: the process's descriptors 1 and 2, which its ranks inherit too), its exit
status (``SystemExit``'s code; 1 for an uncaught exception, printed as the interpreter prints it). The
environment (``env``) and the working directory are the process's, the same for every command. What one command
leaves in the process the next one sees, as in a sweep: a product bug of that kind fails the later command
(test_advisor.py's ``OWN_PROCESS`` names one, found so). A command that never ran (the process ended, or the
timeout, which is for all the commands together, killed it) has the returncode None and the process's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests import launch
from tests.helpers import ROOT

#: the process: each command's output to its own files (stdout, stderr: one file for both where they are the
#: same path), its status written before (null: started) and after each command
DRIVER = """
import json, os, runpy, sys, traceback
jobs, status_file = json.loads(sys.argv[1]), sys.argv[2]


def write(status):
    with open(status_file + ".tmp", "w") as f:
        json.dump(status, f)
    os.replace(status_file + ".tmp", status_file)


status = {}
for name, (program, args, out, err) in jobs.items():
    status[name] = None
    write(status)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    files = [os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for path in dict.fromkeys((out, err))]
    os.dup2(files[0], 1)
    os.dup2(files[-1], 2)
    try:
        if program.startswith("-m "):  # as `python -m MODULE ARGS`: the working directory first on the path
            sys.path[0] = os.getcwd()
            sys.argv = [program[3:], *args]
            runpy.run_module(program[3:], run_name="__main__", alter_sys=True)
        else:  # as `python SCRIPT ARGS`: the script's folder first on the path
            sys.path[0] = os.path.dirname(os.path.abspath(program))
            sys.argv = [program, *args]
            runpy.run_path(program, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, target in zip(saved, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    for fd in files:
        os.close(fd)
    status[name] = code
    write(status)
    print(f"=== {name}: exit {code}", file=sys.stderr, flush=True)
"""


@dataclass
class Job:
    """One command's exit status (None: it did not end; ``started``: whether it began) and output."""

    args: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    started: bool = True

    def check(self) -> "Job":
        assert self.returncode == 0, f"{' '.join(self.args)} failed ({self.returncode}):\n{self.stdout[-3000:]}\n" \
                                     f"{self.stderr[-5000:]}"
        return self


def run(jobs: dict[str, list[str]], out: Path, script: str | Path = ROOT / "run.py", timeout: float = 900,
        env: dict[str, str] | None = None, logs: dict[str, Path] | None = None,
        programs: dict[str, str] | None = None, cwd: Path = ROOT) -> dict[str, Job]:
    """Each of ``jobs`` (name -> the arguments after ``python SCRIPT``), in this order, in one process started in
    ``cwd``; a job named in ``programs`` runs that script instead, or ``-m MODULE`` as ``python -m MODULE`` runs
    it. Their output goes to ``out`` (``NAME.stdout``, ``NAME.stderr``), or for a job named in ``logs`` both to
    that one file. ``env``: the run_cli environment (one thread per rank, unbuffered, Hydra's one-line
    errors) unless given; with a ``PYTHONPATH`` of other modules than the tests' server imported, the process
    is a fresh interpreter (``tests/launch.py``), still one for all the jobs. What the process leaves running
    when it ends is killed."""
    out.mkdir(parents=True, exist_ok=True)
    logs = logs or {}
    files = {name: (logs[name], logs[name]) if name in logs else (out / f"{name}.stdout", out / f"{name}.stderr")
             for name in jobs}
    programs = programs or {}
    spec = {name: [str(programs.get(name, script)), args, *map(str, files[name])] for name, args in jobs.items()}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0") if env is None else env
    status_file = out / "status.json"
    try:
        done = launch.run([sys.executable, "-c", DRIVER, json.dumps(spec), str(status_file)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True)
        printed = f"(the process: exit {done.returncode})\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    except subprocess.TimeoutExpired as e:
        printed = f"(the process: killed after {timeout:.0f} s)\n{e.stderr[-5000:] if e.stderr else ''}"
    status = json.loads(status_file.read_text()) if status_file.exists() else {}
    result = {}
    for name, args in jobs.items():
        stdout, stderr = (f.read_text(errors="replace") if f.exists() else "" for f in files[name])
        if name in logs:
            stderr = ""
        code = status.get(name)
        result[name] = Job(args, code, stdout, stderr if code is not None else f"{stderr}\nnever ended: {printed}",
                           started=name in status)
    return result


@dataclass
class Run:
    """A ``run.py`` job of ``app_runs`` and its run directory."""

    job: Job
    dir: Path

    def summary(self) -> dict:
        """Its summary.json (the job failed: its output)."""
        self.job.check()
        with open(self.dir / "summary.json") as f:
            return json.load(f)


def app_runs(jobs: dict[str, list[str]], root: Path, timeout: float = 900) -> dict[str, Run]:
    """``python run.py ARGS`` for each of ``jobs`` (name -> ARGS), one after another in one process (``run``),
    each with the run directory ``root/NAME`` (``hydra.run.dir``; not for a multirun, whose ARGS name its sweep
    directory), as ``helpers.run_cli`` gives one."""
    multirun = {name for name, args in jobs.items() if any(a.startswith("-m") or a == "--multirun" for a in args)}
    done = run({name: [*args, *([] if name in multirun else [f"hydra.run.dir={root / name}"])]
                for name, args in jobs.items()}, root / "output", timeout=timeout)
    return {name: Run(job, root / name) for name, job in done.items()}
