"""No host synchronisation per training step from lightning_par or Lightning's loop.

A host read of a tensor (``.item()``, ``float(t)``, ``.tolist()``, ``bool(t)``) dispatches
``aten._local_scalar_dense`` (or ``aten.is_nonzero``); on a GPU each one waits for the device. A
dispatch mode records every such read during ``trainer.fit`` with the first stack frame outside
torch, and the test checks which files they come from, step by step. On CPU the reads cost nothing,
but they are the same calls a GPU run makes, so the check holds for both.

Allowed: torch.optim's reads of its CPU step counters (not a device tensor on a GPU: AdamW keeps
``step`` on the host unless capturable/fused), and the reads once per logging interval
(``log_every_n_steps``: Lightning's logger) and at the end of the run. Checked against the summary
callback as it was (one ``float(loss)`` per step): the test failed on every quiet step.
"""

from __future__ import annotations

import traceback
from collections import Counter, defaultdict

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_par.strategies  # noqa: F401  (registers lp_single)
from lightning_par.callbacks import MemoryMonitor, RunSummary, ThroughputMonitor
from lightning_par.callbacks.guard import RunGuard
from lightning_par.data import SyntheticTokens
from lightning_par.models import GPTModule

READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.by_step: dict[int, Counter] = defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            stack = traceback.extract_stack()[:-1]
            if not any("/torch/optim/" in f.filename for f in stack):  # the optimizer's host-side step counters
                outside = [f for f in stack if "/torch/" not in f.filename]
                where = f"{outside[-1].filename}:{outside[-1].lineno}" if outside else "?"
                self.by_step[self.step][where] += 1
        return func(*args, **(kwargs or {}))


class StepMarker(L.Callback):
    def __init__(self, mode: HostReads) -> None:
        self.mode = mode

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mode.step = trainer.global_step + 1  # reads from here on belong to this step


@pytest.mark.timeout(300)
def test_no_host_reads_between_logging_intervals(tmp_path):
    steps, every = 12, 5
    mode = HostReads()
    model = GPTModule(preset="gpt_tiny", seq_len=32)
    data = SyntheticTokens(n_samples=256, seq_len=32, vocab_size=model.config.vocab_size, global_batch_size=4)
    trainer = L.Trainer(strategy="lp_single", accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=every,
                        enable_checkpointing=False, logger=L.pytorch.loggers.CSVLogger(tmp_path), limit_val_batches=0,
                        enable_model_summary=False, enable_progress_bar=True, default_root_dir=tmp_path,
                        callbacks=[MemoryMonitor(), ThroughputMonitor(warmup_steps=1), RunGuard(),
                                   RunSummary(output_dir=str(tmp_path)), StepMarker(mode)])
    with mode:
        trainer.fit(model, datamodule=data)
    assert trainer.global_step == steps
    # on a logging step Lightning and the summary read the loss: allowed; every other step: none
    quiet = [s for s in range(2, steps) if s % every and (s + 1) % every]
    offending = {s: dict(mode.by_step[s]) for s in quiet if mode.by_step[s]}
    assert not offending, offending
    # the check can see reads: a logging step reads the loss (Lightning's logger)
    assert any("/lightning/" in loc for loc in mode.by_step[every]), dict(mode.by_step[every])
