"""A real one-node Slurm on localhost for tests.

``start_cluster(root)`` installs ``slurm-wlm`` and ``munge`` with apt-get when they are missing,
starts munged (unless one already answers), writes a private ``slurm.conf`` under ``root`` (state,
spool, log and pid files there too, so every test session gets its own cluster and job ids), starts
slurmctld and slurmd, and polls ``sinfo`` until the node is idle. The config is selected with the
``SLURM_CONF`` environment variable (``cluster.env``), so nothing under /etc/slurm is written and two
sessions on one machine do not collide: the controller and node ports are picked free each time.
``cluster.stop()`` reads the daemons' pid files first (slurmd deletes its own on exit), then
terminates exactly those processes and waits for them.

Only where Slurm truly cannot be had (not Linux, not root and not installed, no apt-get, the
packages fail to install) does it raise ``SlurmUnavailable`` -- the fixture turns that into a skip
with the reason. A cluster that is installed but does not come up is an error, with the daemons'
logs in the message.

Run it by hand to poke at a cluster:  ``python tests/slurm_cluster.py`` (Ctrl-C stops it).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
SBIN = Path("/usr/sbin")
CLIENTS = ("sbatch", "squeue", "sinfo", "srun", "scontrol", "scancel")
MUNGE_DIRS = ("/run/munge", "/var/lib/munge", "/var/log/munge")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or run on this machine (a reason to skip, not a failure)."""


def _run(cmd: list[str], timeout: float, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc


def _installed() -> bool:
    return all((SBIN / d).exists() for d in ("slurmctld", "slurmd", "munged")) and all(
        shutil.which(c) for c in CLIENTS)


def ensure_installed(timeout: float = 900) -> None:
    """apt-get install slurm-wlm munge, only if some binary is missing."""
    if not sys.platform.startswith("linux"):
        raise SlurmUnavailable(f"a local Slurm needs Linux (this is {sys.platform})")
    if _installed():
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurm-wlm/munge are not installed and installing them needs root")
    if not shutil.which("apt-get"):
        raise SlurmUnavailable("slurm-wlm/munge are not installed and there is no apt-get to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        upd = _run(["apt-get", "update"], timeout=timeout / 2, env=env, check=False)
        inst = _run(["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES], timeout=timeout / 2, env=env,
                    check=False)
    except subprocess.TimeoutExpired as e:
        raise SlurmUnavailable(f"apt-get did not finish in time ({e.timeout:.0f} s)") from None
    if inst.returncode != 0 or not _installed():
        tail = (inst.stderr or inst.stdout or upd.stderr).strip().splitlines()[-3:]
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {' | '.join(tail)}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _read_pid(path: Path, timeout: float = 10) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            time.sleep(0.05)
    return None


def _munge_ok() -> bool:
    if not shutil.which("munge") or not shutil.which("unmunge"):
        return False
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        if cred.returncode != 0:
            return False
        return subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _mem_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return max(int(int(line.split()[1]) / 1024 * 0.9), 1)
    return 1024


def _chown(path: Path, user: str) -> None:
    shutil.chown(path, user=user, group=user)


SLURM_CONF = """\
# one-node test cluster (tests/slurm_cluster.py)
ClusterName=lpar-test
SlurmctldHost=localhost
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
StateSaveLocation={state}
SlurmdSpoolDir={spool}
SlurmctldPidFile={run}/slurmctld.pid
SlurmdPidFile={run}/slurmd.pid
SlurmctldLogFile={log}/slurmctld.log
SlurmdLogFile={log}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    env: dict[str, str]                       # os.environ + SLURM_CONF: use for every Slurm client call
    pid_files: list[Path] = field(default_factory=list)  # daemons this cluster started, read at stop()
    started_munged: int | None = None

    # ---- client helpers -------------------------------------------------------------------------
    def run(self, cmd: list[str], timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=kw.pop("env", self.env), **kw)

    def sbatch(self, args: list[str], timeout: float = 60, env: dict | None = None, cwd: str | None = None) -> int:
        """Submit; returns the job id (``sbatch --parsable``)."""
        proc = self.run(["sbatch", "--parsable", *args], timeout=timeout, env=env or self.env, cwd=cwd)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def job_state(self, job_id: int) -> str | None:
        """The job's state while it is known to the controller (PENDING, RUNNING, COMPLETED, FAILED ...)."""
        proc = self.run(["scontrol", "-o", "show", "job", str(job_id)], timeout=30)
        for token in proc.stdout.split():
            if token.startswith("JobState="):
                return token.split("=", 1)[1]
        return None

    def wait_job(self, job_id: int, timeout: float = 300, poll: float = 0.5) -> str | None:
        """Poll ``squeue -h -j ID`` until the job has left the queue; returns its final state (from
        scontrol, which remembers finished jobs for MinJobAge seconds) or None. Raises on timeout
        after cancelling the job."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], timeout=30)
            if proc.returncode == 0 and not proc.stdout.strip():
                return self.job_state(job_id)
            if proc.returncode != 0 and "Invalid job id" in proc.stderr:
                return self.job_state(job_id)
            time.sleep(poll)
        self.run(["scancel", str(job_id)], timeout=30)
        raise TimeoutError(f"Slurm job {job_id} still queued/running after {timeout:.0f} s "
                           f"(state {self.job_state(job_id)}); cancelled")

    def queue(self) -> list[str]:
        """Ids of the jobs (array tasks too) still pending or running."""
        proc = self.run(["squeue", "-h", "-o", "%i"], timeout=30)
        return proc.stdout.split() if proc.returncode == 0 else []

    def wait_empty(self, timeout: float = 60, poll: float = 0.5) -> list[str]:
        """Poll until no job is queued or running; returns what is left at the deadline."""
        deadline = time.monotonic() + timeout
        left = self.queue()
        while left and time.monotonic() < deadline:
            time.sleep(poll)
            left = self.queue()
        return left

    def logs(self, lines: int = 40) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            p = self.root / "log" / name
            if p.exists():
                out.append(f"--- {p}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    # ---- lifecycle --------------------------------------------------------------------------------
    def stop(self, timeout: float = 30) -> None:
        """Stop what this cluster started. Jobs still queued or running are cancelled first and waited
        for (so no job step outlives slurmd); then the daemons' pids are read from their pid files
        (slurmd removes its own on exit), each gets SIGTERM and is waited for (SIGKILL after ``timeout``)."""
        if self.pid_files:
            try:
                left = self.queue()
                if left:
                    self.run(["scancel", *left], timeout=30)
                    self.wait_empty(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        pids = [pid for pid in (_read_pid(p, timeout=0.5) for p in self.pid_files) if pid]
        if self.started_munged:
            pids.append(self.started_munged)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        for pid in pids:
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.pid_files, self.started_munged = [], None


def _start_munge() -> int | None:
    """Start munged as user munge if no munged answers; returns its pid when we started it."""
    if _munge_ok():
        return None
    key_dir, key = Path("/etc/munge"), Path("/etc/munge/munge.key")
    key_dir.mkdir(parents=True, exist_ok=True)
    if not key.exists():
        key.write_bytes(os.urandom(1024))
    for d in MUNGE_DIRS:
        Path(d).mkdir(parents=True, exist_ok=True)
        _chown(Path(d), "munge")
    for p in [key_dir, *key_dir.iterdir()]:
        _chown(p, "munge")
    key_dir.chmod(0o700)
    key.chmod(0o400)
    proc = _run(["runuser", "-u", "munge", "--", str(SBIN / "munged")], timeout=30, check=False)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not _munge_ok():
        time.sleep(0.1)
    if not _munge_ok():
        raise RuntimeError(f"munged did not start (exit {proc.returncode}): {proc.stderr.strip()}")
    return _read_pid(Path("/run/munge/munged.pid"), timeout=5)


def start_cluster(root: Path, timeout: float = 60) -> SlurmCluster:
    """Install if needed and start a one-node cluster whose files live under ``root``."""
    ensure_installed()
    if os.geteuid() != 0:
        raise SlurmUnavailable("starting slurmctld/slurmd/munged needs root")
    root = Path(root)
    dirs = {name: root / name for name in ("state", "spool", "log", "run")}
    for name, d in dirs.items():
        d.mkdir(parents=True, exist_ok=True)
        if name != "spool":  # slurmctld (user slurm) writes state, logs and its pid file
            _chown(d, "slurm")
    root.chmod(0o755)
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(ctld_port=_free_port(), slurmd_port=_free_port(), cpus=os.cpu_count() or 1,
                                      mem=_mem_mib(), **{k: str(v) for k, v in dirs.items()}))
    conf.chmod(0o644)
    env = dict(os.environ, SLURM_CONF=str(conf))
    cluster = SlurmCluster(root=root, conf=conf, env=env)
    try:
        cluster.started_munged = _start_munge()
        for daemon, args, pid_file in (("slurmctld", [], "slurmctld.pid"), ("slurmd", ["-N", "localhost"], "slurmd.pid")):
            proc = _run([str(SBIN / daemon), "-f", str(conf), *args], timeout=30, env=env, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"{daemon} exited {proc.returncode}: {proc.stderr.strip()}")
            cluster.pid_files.append(dirs["run"] / pid_file)
            if _read_pid(dirs["run"] / pid_file) is None:
                raise RuntimeError(f"{daemon} wrote no pid file")
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = cluster.run(["sinfo", "-h", "-o", "%t"], timeout=15).stdout.strip()
            if state == "idle":
                return cluster
            time.sleep(0.2)
        raise RuntimeError(f"node not idle after {timeout:.0f} s (sinfo: {state!r})")
    except BaseException as e:
        logs = cluster.logs()
        cluster.stop()
        if isinstance(e, Exception) and not isinstance(e, SlurmUnavailable):
            raise RuntimeError(f"local Slurm did not start: {e}\n{logs}") from e
        raise


if __name__ == "__main__":
    import tempfile

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)  # background shells ignore SIGINT
    signal.signal(signal.SIGINT, _interrupt)
    c = start_cluster(Path(tempfile.mkdtemp(prefix="lpar-slurm-")))
    print(f"cluster up: export SLURM_CONF={c.conf}   (Ctrl-C or kill -TERM {os.getpid()} to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
        shutil.rmtree(c.root, ignore_errors=True)
