"""Imported by the fork server of ``fork_ranks.py`` only, as its first preload, and nowhere else: it blocks
SIGTERM in the server. A scheduler's SIGTERM to the whole process group must reach the ranks, which stop
together at an agreed step, and not kill the server, whose death would kill every rank (``PR_SET_PDEATHSIG``)
before that stop. Blocked, not ignored: a rank inherits the mask, and a SIGTERM that reaches it before it
unblocks (``fork_ranks._enter_rank``) stays pending and is delivered then, not lost.

The server dies with the launching process (``PR_SET_PDEATHSIG``, as a rank does with the server): it may be
started before the job's config is checked (``cli._prestart_fork_server``), and a launcher that then exits
on a refused config must not leave it importing for seconds. Its alive pipe would end it only after its
preloads."""

import os
import signal

from lightning_par.core.fork_ranks import LAUNCHER_PID, die_with_parent

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
die_with_parent()
if os.environ.get(LAUNCHER_PID) not in (None, str(os.getppid())):  # the launcher died before that was set
    os._exit(1)  # (compared with its pid, not with 1: in a container the launcher may be pid 1 itself)
