"""Fault injection for tests: a callback that kills one rank with SIGKILL at a given step, on the
first attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0), as a crashed node would."""

from __future__ import annotations

import os
import signal

import lightning as L


class KillRankAt(L.Callback):
    def __init__(self, step: int, rank: int = 1) -> None:
        self.step = step
        self.rank = rank

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
