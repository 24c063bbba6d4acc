"""Imported by the fork server of ``fork_ranks.py`` only, as its first preload, and nowhere else: it blocks
SIGTERM in the server. A scheduler's SIGTERM to the whole process group must reach the ranks, which stop
together at an agreed step, and not kill the server, whose death would kill every rank (``PR_SET_PDEATHSIG``)
before that stop. Blocked, not ignored: a rank inherits the mask, and a SIGTERM that reaches it before it
unblocks (``fork_ranks._enter_rank``) stays pending and is delivered then, not lost."""

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
