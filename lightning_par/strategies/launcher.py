"""A process launcher that works under Hydra multirun.

Lightning's ``_SubprocessScriptLauncher`` starts ranks 1..N-1 by re-running the script with the
same command line. Under Hydra multirun that command line contains the whole sweep (``-m
strategy=single,ddp``), so every child would re-run the sweep (Lightning #15737). This launcher
keeps Lightning's machinery (environment variables, process observer, thread limits) and only
replaces the children's command when one is given: ``run.py`` hands over a command that starts
``python -m lightning_par.child <resolved config>`` -- the child trains exactly this job's config,
in this job's output directory, with no Hydra sweep at all. Without a command (a user's own
script), the behaviour is Lightning's.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher


class ChildCommandLauncher(_SubprocessScriptLauncher):
    def __init__(self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int,
                 child_command: Sequence[str] | None = None, child_cwd: str | None = None) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.child_command = list(child_command) if child_command else None
        self.child_cwd = child_cwd

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """As Lightning's, but the job ends cleanly: after this rank's work returns, wait for the
        children and retire the process observer. (Lightning leaves its observer running; in a
        multirun it would outlive its job and kill the parent during the next one if a finished
        child exits abnormally, e.g. gloo's occasional abort at interpreter shutdown.)"""
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        observer = None
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            observer = _ChildProcessObserver(child_processes=self.procs, main_pid=os.getpid())
            observer.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        result = function(*args, **kwargs)
        if observer is not None:
            observer._finished = True  # its loop ends at its next wake-up
            for proc in self.procs:
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
        return result

    def _call_children_scripts(self) -> None:
        if self.child_command is None:
            return super()._call_children_scripts()
        self._check_can_spawn_children()
        self.procs = []
        env = self.cluster_environment
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["NODE_RANK"] = str(env.node_rank())
        os.environ["LOCAL_RANK"] = str(env.local_rank())
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        for local_rank in range(1, self.num_processes):
            child_env = os.environ.copy()
            child_env["LOCAL_RANK"] = str(local_rank)
            self.procs.append(subprocess.Popen(self.child_command, env=child_env, cwd=self.child_cwd))
        return None
