"""A process launcher that works under Hydra multirun.

Lightning's ``_SubprocessScriptLauncher`` starts ranks 1..N-1 by re-running the script with the
same command line. Under Hydra multirun that command line contains the whole sweep (``-m
strategy=single,ddp``), so every child would re-run the sweep (Lightning #15737). This launcher
keeps Lightning's machinery (environment variables, process observer, thread limits) and only
replaces the children's command when one is given: ``run.py`` hands over a command that starts
``python -m lightning_par.run.child <resolved config>`` -- the child trains exactly this job's config,
in this job's output directory, with no Hydra sweep at all. For a CPU job the ranks are not fresh
interpreters but forks of a server that imported those modules once (``fork_ranks.py``: a rank starts in a
fraction of a second instead of 4-8 s of imports). Without a command (a user's own
script), the children are Lightning's re-runs of the script: they live until the script ends, so
several ``fit``/``test`` calls in one script share them, as with Lightning's own launcher. On a CPU
job outside Hydra those re-runs are forks of the same server too (the script runs in each as
``__main__``; its heavy imports are the server's).

A job owns its children from start to end, on every exit path:

- Lightning's ``_ChildProcessObserver`` polls the children; when one dies it SIGKILLs the others
  *and the main process* -- in a sweep that is the whole sweep. Ours (``_JobObserver``) kills the
  other children only and records which rank died; the main rank's pending collective then fails
  (its peers are gone) and the job raises ``RankDied`` naming the dead rank, which run.py turns into
  this job's ``error.json`` while the sweep goes on. One case cannot be saved: a child that dies
  before the ranks have connected leaves rank 0 in torch's rendezvous, which ignores signals; after
  ``_NOTICE_S + _GIVE_UP_S`` seconds the observer writes the job's ``error.json`` and ends the
  process (in a sweep, the sweep ends there) instead of waiting out the 30-minute timeout.
- The observer is retired and the children are reaped (waited for, killed after a grace period) in
  a ``finally``: after success, an exception, or a stop on SIGTERM. (Lightning leaves its observer
  running; in a multirun it outlived its job and killed the parent during the next one.) Where the
  main process dies without running any code (SIGKILL), Linux kills the children with it
  (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Any

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lightning_par.core.fork_ranks import ChildEntry, die_with_parent, fork_context, fork_rank, script_entry

# seconds the children get to finish after rank 0's work returned, after an error every rank raised
# alike, and after rank 0 failed on its own (they wait in a collective for it: NCCL's is aborted; gloo's
# cannot be -- torch's abort is NCCL's only, and a gloo group closes its sockets only when its last
# reference goes, which a mesh or a strategy still holds -- so they are killed)
_GRACE_OK_S = 120.0
_GRACE_FAILED_S = 20.0
_GRACE_OWN_FAILURE_S = 1.0
# after a child died, seconds the main rank gets to notice (its collective fails) before it is
# interrupted, and then before this process gives up on it (see _JobObserver.run)
_NOTICE_S = 60.0
_GIVE_UP_S = 30.0
# after rank 0 failed on its own, seconds to wait for a child's death to show (ChildCommandLauncher._settle)
_SETTLE_S = 3.0


def _is_peer_failure(e: BaseException, observer_interrupted: bool = True) -> bool:
    """Whether rank 0's error is what a dead peer causes: a failed collective (gloo/NCCL report a closed
    or reset connection as DistError or a RuntimeError naming the backend), or the observer's interrupt
    (a ``KeyboardInterrupt`` the observer sent; one it did not send is a person's Ctrl-C)."""
    import torch.distributed as dist

    if isinstance(e, KeyboardInterrupt):
        return observer_interrupted
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(k in text for k in ("gloo", "nccl", "connection", "broken pipe"))


class RankDied(RuntimeError):
    """A child rank of this job exited abnormally."""


#: how a SIGKILL reads: the kernel's out-of-memory killer sends it, and so do people and schedulers
SIGKILL_LABEL = "killed (SIGKILL: out of memory, or sent by a person or a scheduler)"


def describe_exit(code: int) -> str:
    """A child's return code in words; SIGKILL (``-9``, or ``137`` through a shell) says who sends it
    instead of a bare number."""
    if code in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return SIGKILL_LABEL
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _JobObserver(_ChildProcessObserver):
    """Lightning's observer, but a dead child fails only this job: the other children are killed,
    the main process is left alive (see the module docstring)."""

    def __init__(self, child_processes: list[subprocess.Popen], sleep_period: float = 1.0,
                 output_dir: str | None = None) -> None:
        super().__init__(main_pid=os.getpid(), child_processes=child_processes, sleep_period=sleep_period)
        self.dead: tuple[int, int] | None = None  # (global rank, return code) of the first child that died
        self.interrupted = False  # whether this observer interrupted the main thread (run)
        self.output_dir = output_dir
        self._retired = threading.Event()

    def _terminate_all(self) -> None:
        for i, proc in enumerate(self._child_processes):
            if proc.returncode and self.dead is None:
                self.dead = (i + 1, proc.returncode)
        for proc in self._child_processes:
            if proc.poll() is None:
                proc.kill()

    def run(self) -> None:
        super().run()
        if self.dead is None or self._retired.wait(_NOTICE_S):
            return
        # gloo's pending collective fails at once when the peers' sockets close. A main rank still
        # blocked gets KeyboardInterrupt, delivered as soon as it runs Python code again ...
        import _thread

        self.interrupted = True
        _thread.interrupt_main()
        if self._retired.wait(_GIVE_UP_S):
            return
        # ... but torch's rendezvous (a child that died before the ranks connected) waits in C++ and
        # ignores signals until its 30-minute timeout. Record the job's failure and end the process:
        # in a sweep this ends the sweep, with a record, rather than hanging it.
        import sys

        from lightning_par.core.jobs import record_failure

        rank, code = self.dead
        error = RankDied(f"rank {rank} died ({describe_exit(code)}) before the ranks connected; "
                         "torch's rendezvous cannot be interrupted, so this process exits")
        record_failure(error, self.output_dir)
        print(f"error: {error}", file=sys.stderr, flush=True)
        os._exit(1)

    def retire(self) -> None:
        self._finished = True
        self._retired.set()


class ChildCommandLauncher(_SubprocessScriptLauncher):
    def __init__(self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int,
                 child_command: ChildEntry | Sequence[str] | None = None, child_cwd: str | None = None,
                 fork_script: bool = False) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        #: without a command (a user's script): whether its re-runs are forked (a CPU job) or started
        self.fork_script = fork_script
        #: a ChildEntry (forked from the fork server where the platform has one), or a command started as it is
        self.child_command = child_command if child_command is None or isinstance(child_command, ChildEntry) \
            else list(child_command)
        self.child_cwd = child_cwd

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """As Lightning's, but the job owns its children on every exit path (module docstring)."""
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        observer = None
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            observer = _JobObserver(self.procs, output_dir=getattr(trainer, "default_root_dir", None))
            observer.start()
        ok = shared = own_failure = False
        try:
            _set_num_threads_if_needed(num_processes=self.num_processes)
            result = function(*args, **kwargs)
            ok = True
        except BaseException as e:
            shared = bool(getattr(e, "all_ranks", False))
            # an error every rank raised at the same step (a non-finite loss, a stop on SIGTERM) is the
            # job's own; otherwise a child that died explains why rank 0's collective failed
            if observer is not None and not shared:
                if isinstance(e, KeyboardInterrupt) and not observer.interrupted:
                    # a person's Ctrl-C before training (in training the run guard stops at a step): the
                    # children die of it, so none is to blame; end their collectives now
                    own_failure = True
                    _abort_process_group()
                    raise
                self._settle(observer, peer_failure=_is_peer_failure(e, observer.interrupted))
                if observer.dead is not None:
                    rank, code = observer.dead
                    raise RankDied(_rank_failure(rank, code, observer.output_dir)) from e
                # rank 0 failed on its own: the children wait in a collective for it, so they are ended
                # now (the process group aborted, then the reap's short grace), not after the reap's
                # usual grace period or the collective's 30-minute timeout
                own_failure = True
                _abort_process_group()
            raise
        finally:
            # our children (one job's ranks) end with the job; a user's script re-run by Lightning
            # goes on after this fit (a second fit, a test run), so on success -- or on an error every
            # rank raised alike, such as a strategy's refusal of the model, which each rank's script
            # handles as rank 0's does -- its children are left running and watched, as Lightning does
            if observer is not None and (self.child_command is not None or not (ok or shared)):
                observer.retire()
                self.reap(_GRACE_OK_S if ok else _GRACE_OWN_FAILURE_S if own_failure else _GRACE_FAILED_S)
        if observer is not None and observer.dead is not None:  # died after rank 0 had finished its work
            rank, code = observer.dead
            raise RankDied(_rank_failure(rank, code, observer.output_dir) + " at the end of the job")
        return result

    @staticmethod
    def _settle(observer: _JobObserver, peer_failure: bool, wait_s: float = _SETTLE_S) -> None:
        """Decide whether a dead child is the job's error, rank 0's having failed.

        A child killed by a signal (the kernel's SIGKILL) always is. A child that exited with a code of
        its own is only when rank 0's error is a failed collective (``peer_failure``): otherwise both
        raised an error of their own -- often the same one (a full disk), in any order -- and rank 0's
        error, which names the cause, is the job's. Rank 0's collective fails as soon as the dead rank's
        sockets close, while that process is still exiting: its ``poll()`` can read None a moment more
        (longer on a loaded machine), so wait up to ``wait_s`` for an exit to show. Only failed jobs wait."""
        import time

        deadline = time.monotonic() + (wait_s if peer_failure else 0.0)
        while True:
            codes = [p.poll() for p in observer._child_processes]
            if any(c is not None and c < 0 for c in codes) or (peer_failure and any(codes)):
                observer._run()  # record the dead rank (first one by rank order) and kill the others
                return
            if time.monotonic() >= deadline:
                observer.dead = observer.dead if observer.dead is not None and observer.dead[1] < 0 else None
                return
            time.sleep(0.05)

    def reap(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` in all for the children to exit, then kill the rest."""
        import time

        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _call_children_scripts(self) -> None:
        if self.child_command is None and not self._forks_script():
            return super()._call_children_scripts()
        self._check_can_spawn_children()
        self.procs = []
        env = self.cluster_environment
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["NODE_RANK"] = str(env.node_rank())
        os.environ["LOCAL_RANK"] = str(env.local_rank())
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        entry = self.child_command if isinstance(self.child_command, ChildEntry) else None
        cwd = self.child_cwd
        if self.child_command is None:  # a user's script, re-run on each rank as Lightning's launcher does
            entry, cwd = script_entry(), os.getcwd()
        forked = entry is not None and fork_context(entry) is not None
        command = entry.command() if entry is not None else self.child_command
        try:
            for local_rank in range(1, self.num_processes):
                child_env = os.environ.copy()
                child_env["LOCAL_RANK"] = str(local_rank)
                child_env["RANK"] = str(env.node_rank() * self.num_processes + local_rank)  # for error.json's rank
                # torch's C++ warnings carry a native stack of ~50 lines; a child's are of a peer gone (rank 0
                # stopped or failed, and reports why in one line): errors only, unless the user set a level
                child_env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
                if forked:
                    self.procs.append(fork_rank(entry, child_env, cwd, f"rank{local_rank}"))
                else:
                    self.procs.append(subprocess.Popen(command, env=child_env, cwd=cwd, preexec_fn=die_with_parent))
            if forked and self.child_command is None:
                # a user's script: its re-runs outlive this fit as Lightning's commands do, but a forked one
                # dies with this process (the server follows it), so this process waits for them at its exit
                import atexit

                atexit.register(self.reap, _GRACE_OK_S)
        except BaseException:
            # a rank that could not start (no memory, no process slots, the server gone): the ranks already
            # started would wait in the rendezvous for it until its timeout
            for proc in self.procs:
                proc.kill()
                proc.wait()
            raise
        return None


    def _forks_script(self) -> bool:
        """Whether a user's script is re-run on ranks 1..N-1 as forks of the fork server: a CPU job outside
        Hydra (whose re-runs Lightning starts with Hydra's run directory on the command line) on Linux.
        Everything else is Lightning's own start of the re-runs."""
        import sys

        if not (self.fork_script and sys.platform.startswith("linux")):
            return False
        try:
            from hydra.core.hydra_config import HydraConfig
        except ImportError:
            return True
        return not HydraConfig.initialized()


def _rank_failure(rank: int, code: int, output_dir: str | None) -> str:
    """One line for a child rank that ended the job: how it exited and, when it recorded one, its own
    error (``jobs.record_rank_failure``: a child prints nothing itself, so each failure reads once)."""
    from lightning_par.core.jobs import read_rank_failure

    own = read_rank_failure(output_dir, rank) if output_dir else None
    if own is not None:
        return f"rank {rank} failed ({describe_exit(code)}): {own}"
    return f"rank {rank} died ({describe_exit(code)})"


def _abort_process_group() -> None:
    """Abort this process's default process group, if any (torch's ``_abort_process_group``: gloo
    closes its sockets, NCCL aborts its communicators); peers blocked in a collective then fail."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    except Exception:  # noqa: BLE001 -- an older torch without it: the reap's grace period still ends them
        pass
