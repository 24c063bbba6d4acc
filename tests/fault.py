"""Fault injection for tests: a callback that kills one rank with SIGKILL at a given step, on the
first attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0), as a crashed node would."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import lightning as L


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux ``/proc``): children, theirs, and so on."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # the task ended meanwhile
                continue
            found += kids
            todo += kids
    return found


class KillRankAt(L.Callback):
    """With ``record``: before the kill, the rank's descendants' pids go to that file (JSON), so a test
    can see that none outlives it, however they were started. With ``others_pause_s``: the other ranks
    sleep that long at the same step, outside any collective, so that only the killed rank's death (not a
    failed collective) can end them sooner."""

    def __init__(self, step: int, rank: int = 1, record: str | None = None, others_pause_s: float = 0.0) -> None:
        self.step = step
        self.rank = rank
        self.record = record
        self.others_pause_s = others_pause_s

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_rank != self.rank and trainer.global_step == self.step:
            import time

            time.sleep(self.others_pause_s)
        if first_attempt and trainer.global_rank == self.rank and trainer.global_step == self.step:
            if self.record:
                Path(self.record).write_text(json.dumps(descendants(os.getpid())))
            os.kill(os.getpid(), signal.SIGKILL)


class RecordRankState(L.Callback):
    """What a rank inherited at its start, recorded when its callbacks are built (before the Trainer):
    Lightning's rank-zero state, SIGTERM's disposition, multiprocessing's start method, whether it was
    forked by multiprocessing; written to ``<run dir>/rank-state-<rank>.json`` at setup."""

    def __init__(self) -> None:
        import multiprocessing

        from lightning.fabric.utilities.rank_zero import rank_zero_only

        self.state = {"env_rank": int(os.environ.get("RANK", "0")), "rank_zero_only": rank_zero_only.rank,
                      "sigterm": str(signal.getsignal(signal.SIGTERM)),
                      "sigterm_blocked": signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []),
                      "start_method": multiprocessing.get_start_method(),
                      "forked": multiprocessing.parent_process() is not None}

    def setup(self, trainer: L.Trainer, *args: object, **kwargs: object) -> None:
        path = Path(trainer.default_root_dir) / f"rank-state-{trainer.global_rank}.json"
        path.write_text(json.dumps(self.state))


class RaiseAt(L.Callback):
    """Fault injection: global rank ``rank`` alone raises ``ValueError`` at optimizer step ``step`` (its
    peers go on into the next collective), after writing the wall-clock time to ``marker``."""

    def __init__(self, step: int, marker: str, rank: int = 0) -> None:
        self.step, self.marker, self.rank = step, marker, rank

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            import time

            with open(self.marker, "w") as f:
                f.write(repr(time.time()))
            raise ValueError(f"injected fault on rank {self.rank} at step {self.step}")


class PauseInSetup(L.Callback):
    """Fault injection: global rank 0 writes its pid to ``marker`` in ``setup`` (before the model is built
    and wrapped; its peers go on to the next barrier) and sleeps ``pause_s``."""

    def __init__(self, marker: str, pause_s: float = 30.0) -> None:
        self.marker, self.pause_s = marker, pause_s

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.global_rank == 0:
            import time

            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(self.pause_s)


class PauseAt(L.Callback):
    """Fault injection: on global rank 0 at optimizer step ``step`` write ``marker`` (this pid) and pause
    ``pause_s``, so a test can signal the run at a known point. Does nothing once the marker exists."""

    def __init__(self, step: int, marker: str, pause_s: float = 5.0) -> None:
        self.step, self.marker, self.pause_s = step, marker, pause_s

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_rank == 0 and trainer.global_step == self.step and not os.path.exists(self.marker):
            import time

            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(self.pause_s)


class FullDiskFrom(L.Callback):
    """Fault injection: from optimizer step ``step`` on, every file torch.distributed.checkpoint writes on
    this rank fails with ``ENOSPC`` after ``after_bytes`` bytes, as a disk that fills during a save."""

    def __init__(self, step: int, after_bytes: int = 1024) -> None:
        self.step, self.after_bytes = step, after_bytes
        self._patched = False

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if self._patched or trainer.global_step < self.step:
            return
        import contextlib
        import errno

        from torch.distributed.checkpoint import filesystem

        original, limit = filesystem.FileSystem.create_stream, self.after_bytes

        class Filling:
            def __init__(self, stream):
                self.stream, self.written = stream, 0

            def write(self, data):
                self.written += len(data)
                if self.written > limit:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return self.stream.write(data)

            def __getattr__(self, name):
                return getattr(self.stream, name)

        @contextlib.contextmanager
        def create_stream(fs, path, mode):
            with original(fs, path, mode) as stream:
                yield Filling(stream) if "w" in mode else stream

        filesystem.FileSystem.create_stream = create_stream
        self._patched = True


def main(argv: list[str]) -> None:
    """``python -m tests.fault CODE``: exit with CODE at once; ``sleep``: sleep a minute (a rank to kill)."""
    import time

    if argv[0] == "sleep":
        time.sleep(60)
    os._exit(int(argv[0]))
