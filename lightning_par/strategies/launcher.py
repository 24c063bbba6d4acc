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

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher


class ChildCommandLauncher(_SubprocessScriptLauncher):
    def __init__(self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int,
                 child_command: Sequence[str] | None = None, child_cwd: str | None = None) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.child_command = list(child_command) if child_command else None
        self.child_cwd = child_cwd

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
