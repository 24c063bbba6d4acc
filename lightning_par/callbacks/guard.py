"""Stop a run safely: on SIGTERM (what Slurm and Kubernetes send) and SIGINT (Ctrl-C), on Slurm's
requeue signal, and on a non-finite training loss.

Why not Lightning's own signal handling: its SIGTERM handler runs a ``broadcast`` *inside the
signal handler*, at whatever point each rank happens to be, and a rank that received SIGTERM on its
own raises at its own step -- the ranks' collectives stop matching and every rank hangs. Ctrl-C is
worse: Python raises ``KeyboardInterrupt`` wherever the main thread is, and where that is a
finalizer or a weakref callback (the pipeline's saved-activation counter runs one per tensor) Python
prints "Exception ignored" and drops it -- the run trained on to its end and exited 0. Here the
handlers only set a flag; the ranks agree at an optimizer-step boundary:

- signals, every optimizer step: each rank starts an asynchronous all-reduce (MAX) of one host-side
  number (which signal it received, if any) over a CPU (gloo) group and reads it at the next step
  boundary, so a signal to any one rank stops every rank one or two steps later, with no device
  synchronisation (on one process the flag is read directly);
- non-finite losses, every ``check_every_n_steps`` optimizer steps (default 10): the same kind of
  all-reduce of a flag that stays on the device (``isfinite`` folded in per micro-batch), read one
  interval later, so the host synchronises with the device once per interval, on work enqueued a
  whole interval earlier;
- Lightning 2.6 itself broadcasts a SIGTERM flag from rank 0 before *every* training batch (a
  blocking collective and a host read, ``_TrainingEpochLoop._broadcast_sigterm_tensor``). With the
  guard's handler in place of Lightning's, that flag is always 0, so the guard turns that broadcast
  off for the run;
- all ranks see the same result at the same step and act together: SIGTERM or SIGINT writes a
  resumable checkpoint (``<checkpoint dir>/stepNNNNNN.ckpt``, found by ``ckpt_path=auto``) and raises
  ``RunStopped`` (exit status 128 + the signal: 143 for SIGTERM, 130 for SIGINT; the message names
  it); under Slurm with auto-requeue the requeue signal runs Lightning's own requeue handler instead
  (an ``hpc_ckpt_N.ckpt`` checkpoint, then ``scontrol requeue``), at the agreed step, so its
  collective checkpoint save cannot deadlock either; a non-finite loss raises ``NonFiniteLoss``
  (``nonfinite: stop``, the default) or prints one warning (``nonfinite: warn``).

The handlers are in place from the start of training to its end (``on_train_start`` to
``teardown``); outside that window SIGINT is Python's ``KeyboardInterrupt`` as usual. Losses of the
last steps, whose check is still in flight when training ends, are checked once more at the end.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

#: what a rank's signal flag says, as one number the ranks MAX-reduce: kind * 100 + the signal's number
#: (a requeue outranks a stop; 0: no signal)
_STOP, _REQUEUE = 1, 2
NONFINITE_ACTIONS = ("stop", "warn")


class RunStopped(SystemExit):
    """The run stopped on a signal after writing a checkpoint; raised on every rank at the same step.
    A ``SystemExit`` (status 128 + the signal's number): it ends a sweep too (the signal was meant
    for the whole process)."""

    all_ranks = True

    def __init__(self, message: str, code: int = 128 + signal.SIGTERM) -> None:
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite; raised on every rank at the same step."""

    all_ranks = True


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RunGuard(L.Callback):
    """See the module docstring.

    Args:
        nonfinite: ``stop`` (error, non-zero exit) or ``warn`` (one warning, training goes on).
        check_every_n_steps: how often the ranks agree on the non-finite flag (each check costs one tiny
            asynchronous all-reduce and one host read of it); a NaN is reported within about twice this
            many steps. Signals are agreed on every step whatever this is.
        checkpoint_dir: where the stop checkpoint goes; None: the ``ModelCheckpoint``'s directory if
            there is one, else ``<default_root_dir>/checkpoints``.
    """

    def __init__(self, nonfinite: str = "stop", check_every_n_steps: int = 10, checkpoint_dir: str | None = None) -> None:
        if nonfinite not in NONFINITE_ACTIONS:
            raise ValueError(f"RunGuard: nonfinite={nonfinite!r}; choose from: {', '.join(NONFINITE_ACTIONS)}")
        if isinstance(check_every_n_steps, bool) or not isinstance(check_every_n_steps, int) or check_every_n_steps < 1:
            raise ValueError(f"RunGuard: check_every_n_steps={check_every_n_steps!r} must be an integer >= 1")
        self.nonfinite = nonfinite
        self.every = int(check_every_n_steps)
        self.checkpoint_dir = checkpoint_dir
        self._signal = 0  # this rank's flag: _STOP/_REQUEUE * 100 + signum
        self._previous: dict[int, Any] = {}  # handlers replaced at train start, restored at teardown
        self._signal_group: Any = None
        self._signal_inflight: tuple[torch.Tensor, Any] | None = None
        self._bad: torch.Tensor | None = None
        self._bad_since = 0
        self._inflight: tuple[torch.Tensor, Any, int, int] | None = None
        self._step_seen = 0
        self._warned = False

    # ------------------------------------------------------------------------------ signals
    def _handler(self, kind: int):
        def handle(signum: int, frame: Any) -> None:
            if signum == signal.SIGINT and self._signal % 100 == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
            if self._signal == 0:
                again = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
                os.write(2, f"received {_signal_name(signum)}: stopping at the next step boundary with a "
                            f"checkpoint{again}\n".encode())
            self._signal = max(self._signal, kind * 100 + signum)
        return handle

    def _install(self, signum: int, kind: int) -> None:
        self._previous.setdefault(signum, signal.getsignal(signum))
        signal.signal(signum, self._handler(kind))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning registered its handlers just before this hook and restores the previous ones at teardown
        if threading.current_thread() is threading.main_thread():
            self._install(signal.SIGTERM, _STOP)
            self._install(signal.SIGINT, _STOP)  # Lightning leaves SIGINT alone: restored in teardown
            # Lightning's SIGTERM flag can no longer be set: its per-batch broadcast of it is dead weight
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
            from lightning.fabric.plugins.environments import SLURMEnvironment

            env = trainer._accelerator_connector.cluster_environment
            if isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal is not None:
                self._install(env.requeue_signal, _REQUEUE)
        self._signal_group = None
        if self._distributed(trainer):
            # the signal flag is a host number: agree on it over gloo (CPU), never through the device
            self._signal_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        self._signal_inflight = None
        self._bad = torch.zeros((), dtype=torch.bool, device=trainer.strategy.root_device)
        self._bad_since = trainer.global_step + 1
        self._inflight = None
        self._step_seen = trainer.global_step

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning restores SIGTERM and its Slurm signal at its own teardown; SIGINT is ours to restore
        previous = self._previous.pop(signal.SIGINT, None)
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)
        self._previous = {}
        if self._signal_group is not None and self._signal_group is not dist.group.WORLD:
            try:
                dist.destroy_process_group(self._signal_group)
            except Exception:  # noqa: BLE001 -- the default group may be gone already (a failed run)
                pass
        self._signal_group = None

    @staticmethod
    def _distributed(trainer: L.Trainer) -> bool:
        return dist.is_available() and dist.is_initialized() and trainer.world_size > 1

    def _agreed_signal(self) -> int:
        """The ranks' agreed signal flag as of the previous step boundary (this rank's own on one process),
        and the next agreement started."""
        if self._signal_group is None:
            return self._signal
        agreed = 0
        if self._signal_inflight is not None:
            flag, work = self._signal_inflight
            work.wait()
            agreed = int(flag.tolist()[0])
        flag = torch.tensor([self._signal], dtype=torch.int64)
        self._signal_inflight = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._signal_group,
                                                       async_op=True))
        return agreed

    # ------------------------------------------------------------------------------ checks
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and self._bad is not None:
            self._bad |= ~torch.isfinite(loss.detach()).all()  # stays on the device
        if trainer.global_step == self._step_seen:  # inside gradient accumulation: not a step boundary
            return
        self._step_seen = trainer.global_step
        sig = self._agreed_signal()
        if trainer.global_step % self.every == 0:
            agreed = self._collect()
            if agreed is not None:
                self._act_nonfinite(trainer, *agreed)
            self._start(trainer)
        if sig:
            # the non-finite check of the same step went first: a run that diverged says so
            self._act_signal(trainer, sig)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Training ended normally on every rank: check what the last steps left unchecked (blocking).
        A signal now comes too late to matter: the run has finished."""
        if self._signal_inflight is not None:
            self._signal_inflight[1].wait()
            self._signal_inflight = None
        if self._bad is None:
            return
        agreed = self._collect()
        if agreed is not None:
            self._act_nonfinite(trainer, *agreed)
        self._start(trainer)
        agreed = self._collect()
        if agreed is not None:
            self._act_nonfinite(trainer, *agreed)

    def _start(self, trainer: L.Trainer) -> None:
        assert self._bad is not None
        flags = self._bad.to(torch.float32).reshape(1)
        work = None
        if self._distributed(trainer):
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
        self._inflight = (flags, work, self._bad_since, trainer.global_step)
        self._bad = torch.zeros_like(self._bad)
        self._bad_since = trainer.global_step + 1

    def _collect(self) -> tuple[float, str] | None:
        """The agreed non-finite flag of the check in flight, and the steps it covered."""
        if self._inflight is None:
            return None
        flags, work, since, until = self._inflight
        self._inflight = None
        if work is not None:
            work.wait()
        nonfinite = flags.tolist()[0]
        return nonfinite, f"step {until}" if since >= until else f"steps {since}-{until}"

    def _act_nonfinite(self, trainer: L.Trainer, nonfinite: float, where: str) -> None:
        if not nonfinite:
            return
        if self.nonfinite == "stop":
            raise NonFiniteLoss(f"non-finite training loss (NaN or inf) at {where}; lower model.lr or "
                                "set trainer.gradient_clip_val (callbacks.guard.nonfinite=warn to go on)")
        if not self._warned and trainer.is_global_zero:
            print(f"warning: non-finite training loss (NaN or inf) at {where}; training goes on "
                  "(callbacks.guard.nonfinite=warn)", file=sys.stderr, flush=True)
        self._warned = True

    def _act_signal(self, trainer: L.Trainer, sig: int) -> None:
        step = trainer.global_step
        kind, signum = divmod(sig, 100)
        if kind == _REQUEUE:
            # Lightning's Slurm requeue: an hpc_ckpt_N.ckpt checkpoint, then `scontrol requeue` on rank 0
            trainer._signal_connector._slurm_sigusr_handler_fn(signum or signal.SIGUSR1, None)
            raise RunStopped(f"requeued with Slurm after step {step}; the requeued job resumes from "
                             f"{trainer.default_root_dir}/hpc_ckpt_*.ckpt")
        path = os.path.join(self._checkpoint_dir(trainer), f"step{step:06d}.ckpt")
        trainer.save_checkpoint(path)
        raise RunStopped(f"stopped by {_signal_name(signum)} after step {step}; checkpoint {path} "
                         "(resume with ckpt_path=auto in the same run directory)", code=128 + signum)

    def _checkpoint_dir(self, trainer: L.Trainer) -> str:
        if self.checkpoint_dir:
            return str(self.checkpoint_dir)
        for cb in trainer.checkpoint_callbacks:
            if getattr(cb, "dirpath", None):
                return str(cb.dirpath)
        return os.path.join(trainer.default_root_dir, "checkpoints")
