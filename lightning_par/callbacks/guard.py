"""Stop a run safely: on SIGTERM (what Slurm and Kubernetes send), on Slurm's requeue signal, and on
a non-finite training loss.

Why not Lightning's own signal handling: its SIGTERM handler runs a ``broadcast`` *inside the
signal handler*, at whatever point each rank happens to be, and a rank that received SIGTERM on its
own raises at its own step -- the ranks' collectives stop matching and every rank hangs. Here the
handler only sets a flag; the ranks agree at an optimizer-step boundary:

- every ``check_every_n_steps`` optimizer steps (default 10 in the app's config) each rank starts an
  asynchronous all-reduce (MAX) of two numbers, [non-finite loss seen, signal received], and reads
  the result at the next check, ``check_every_n_steps`` steps later, so no rank waits for it and the
  host synchronises with the device once per check, on work enqueued a whole interval earlier;
- Lightning 2.6 itself broadcasts a SIGTERM flag from rank 0 before *every* training batch (a
  blocking collective and a host read, ``_TrainingEpochLoop._broadcast_sigterm_tensor``). With the
  guard's handler in place of Lightning's, that flag is always 0, so the guard turns that broadcast
  off for the run: the guard's own check is the ranks' agreement on signals;
- all ranks see the same result at the same step and act together: a signal writes a resumable
  checkpoint (``<checkpoint dir>/stepNNNNNN.ckpt``, found by ``ckpt_path=auto``) and raises
  ``RunStopped`` (exit status 143, 128 + SIGTERM); under Slurm with auto-requeue the requeue signal
  runs Lightning's own requeue handler instead (an ``hpc_ckpt_N.ckpt`` checkpoint, then ``scontrol
  requeue``), at the agreed step, so its collective checkpoint save cannot deadlock either; a
  non-finite loss raises ``NonFiniteLoss`` (``nonfinite: stop``, the default) or prints one warning
  (``nonfinite: warn``).

The non-finite test itself stays on the device (``isfinite`` folded into a flag tensor per
micro-batch). Losses of the last steps, whose check is still in flight when training ends, are
checked once more at the end.
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

_SIGTERM, _REQUEUE = 1.0, 2.0
NONFINITE_ACTIONS = ("stop", "warn")


class RunStopped(SystemExit):
    """The run stopped on a signal after writing a checkpoint; raised on every rank at the same step.
    A ``SystemExit``: it ends a sweep too (the signal was meant for the whole process)."""

    all_ranks = True

    def __init__(self, message: str, code: int = 128 + signal.SIGTERM) -> None:
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite; raised on every rank at the same step."""

    all_ranks = True


class RunGuard(L.Callback):
    """See the module docstring.

    Args:
        nonfinite: ``stop`` (error, non-zero exit) or ``warn`` (one warning, training goes on).
        check_every_n_steps: how often the ranks agree on the flags (each check costs one tiny
            asynchronous all-reduce); a signal is acted on within about twice this many steps.
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
        self._signal = 0.0
        self._signum: int | None = None
        self._bad: torch.Tensor | None = None
        self._bad_since = 0
        self._inflight: tuple[torch.Tensor, Any, int, int] | None = None
        self._step_seen = 0
        self._warned = False

    # ------------------------------------------------------------------------------ signals
    def _handler(self, code: float):
        def handle(signum: int, frame: Any) -> None:
            if self._signal == 0.0:
                os.write(2, f"received {signal.Signals(signum).name}: stopping at the next step boundary with a "
                            "checkpoint\n".encode())
            if code > self._signal:
                self._signal, self._signum = code, signum
        return handle

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning registered its handlers just before this hook and restores the previous ones at teardown
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handler(_SIGTERM))
            # Lightning's SIGTERM flag can no longer be set: its per-batch broadcast of it is dead weight
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
            from lightning.fabric.plugins.environments import SLURMEnvironment

            env = trainer._accelerator_connector.cluster_environment
            if isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal is not None:
                signal.signal(env.requeue_signal, self._handler(_REQUEUE))
        self._bad = torch.zeros((), dtype=torch.bool, device=trainer.strategy.root_device)
        self._bad_since = trainer.global_step + 1
        self._inflight = None
        self._step_seen = trainer.global_step

    # ------------------------------------------------------------------------------ checks
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and self._bad is not None:
            self._bad |= ~torch.isfinite(loss.detach()).all()  # stays on the device
        if trainer.global_step == self._step_seen:  # inside gradient accumulation: not a step boundary
            return
        self._step_seen = trainer.global_step
        if trainer.global_step % self.every:
            return
        agreed = self._collect()
        if agreed is not None:
            self._act(trainer, *agreed)  # may stop the run: then no new check is left in flight
        self._start(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Training ended normally on every rank: check what the last steps left unchecked (blocking)."""
        if self._bad is None:
            return
        agreed = self._collect()  # a signal now comes too late to matter: the run has finished
        if agreed is not None and agreed[0]:
            self._act(trainer, agreed[0], 0.0, agreed[2])
            return
        self._start(trainer)
        agreed = self._collect()
        if agreed is not None and agreed[0]:
            self._act(trainer, agreed[0], 0.0, agreed[2])

    def _start(self, trainer: L.Trainer) -> None:
        assert self._bad is not None
        flags = torch.stack([self._bad.to(torch.float32),
                             torch.tensor(self._signal, dtype=torch.float32, device=self._bad.device)])
        work = None
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
        self._inflight = (flags, work, self._bad_since, trainer.global_step)
        self._bad = torch.zeros_like(self._bad)
        self._bad_since = trainer.global_step + 1

    def _collect(self) -> tuple[float, float, str] | None:
        """The agreed flags of the check in flight, and the steps it covered."""
        if self._inflight is None:
            return None
        flags, work, since, until = self._inflight
        self._inflight = None
        if work is not None:
            work.wait()
        nonfinite, sig = flags.tolist()
        return nonfinite, sig, f"step {until}" if since >= until else f"steps {since}-{until}"

    def _act(self, trainer: L.Trainer, nonfinite: float, sig: float, where: str) -> None:
        step = trainer.global_step
        if nonfinite:
            if self.nonfinite == "stop":
                raise NonFiniteLoss(f"non-finite training loss (NaN or inf) at {where}; lower model.lr or "
                                    "set trainer.gradient_clip_val (callbacks.guard.nonfinite=warn to go on)")
            if not self._warned and trainer.is_global_zero:
                print(f"warning: non-finite training loss (NaN or inf) at {where}; training goes on "
                      "(callbacks.guard.nonfinite=warn)", file=sys.stderr, flush=True)
            self._warned = True
        if sig == _REQUEUE:
            # Lightning's Slurm requeue: an hpc_ckpt_N.ckpt checkpoint, then `scontrol requeue` on rank 0
            trainer._signal_connector._slurm_sigusr_handler_fn(self._signum or signal.SIGUSR1, None)
            raise RunStopped(f"requeued with Slurm after step {step}; the requeued job resumes from "
                             f"{trainer.default_root_dir}/hpc_ckpt_*.ckpt")
        if sig:
            path = os.path.join(self._checkpoint_dir(trainer), f"step{step:06d}.ckpt")
            trainer.save_checkpoint(path)
            raise RunStopped(f"stopped by SIGTERM after step {step}; checkpoint {path} "
                             "(resume with ckpt_path=auto in the same run directory)")

    def _checkpoint_dir(self, trainer: L.Trainer) -> str:
        if self.checkpoint_dir:
            return str(self.checkpoint_dir)
        for cb in trainer.checkpoint_callbacks:
            if getattr(cb, "dirpath", None):
                return str(cb.dirpath)
        return os.path.join(trainer.default_root_dir, "checkpoints")
