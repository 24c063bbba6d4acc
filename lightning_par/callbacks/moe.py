"""MoE measurements: tokens per expert per step, load balance, dropped tokens, all-to-all bytes.

Every MoE layer leaves its last forward's figures in ``MoE.last_stats`` (device tensors: routed
assignments per expert, dropped assignments; the all-to-all bytes as a Python int, which the
dispatcher knows on the host anyway). After each training batch this callback adds them to a
device buffer of the current optimizer step -- no host read, no collective. Every
``flush_every_n_steps`` steps the finished steps are moved to the host (one read per interval),
and at the end of training one all-reduce sums the per-step counts over the data-parallel ranks,
so the figures are those of the global batch. A model without MoE layers: nothing happens and
``summary()`` is empty.

``summary()`` -> ``{"moe": {...}}``:

- ``tokens_per_expert``: per step, per MoE layer, per expert: routed assignments (tokens x top_k,
  after capacity drops) over the global batch;
- ``load_balance_max_over_mean``: per step, the max over layers of max/mean tokens per expert
  (1.0 = perfectly balanced; n_experts = everything on one expert); ``..._mean``: over all steps;
- ``dropped_fraction``: assignments dropped by the capacity limit / all assignments (0 dropless);
- ``all_to_all_bytes_per_step``: bytes this rank sent to other ranks by all-to-all in one step,
  forward and backward (the backward sends as much again); mean over ranks and steps.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lightning_par.models.moe import MoE


class MoEMonitor(L.Callback):
    def __init__(self, flush_every_n_steps: int = 50) -> None:
        self.flush_every_n_steps = max(1, int(flush_every_n_steps))
        self._layers: list[MoE] = []
        self._current: torch.Tensor | None = None  # (layers, experts + 1): counts, then dropped
        self._pending: list[torch.Tensor] = []  # finished steps still on the device
        self._host: list[torch.Tensor] = []
        self._a2a_bytes = 0
        self._step_seen = 0
        self._summary: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._layers = [m for m in pl_module.modules() if isinstance(m, MoE)]
        self._step_seen = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._layers:
            return
        stats = [m.last_stats for m in self._layers]
        if all(stats):
            row = torch.stack([torch.cat([s["tokens_per_expert"], s["dropped"].reshape(1)]) for s in stats])
            self._current = row if self._current is None else self._current + row
            self._a2a_bytes += 2 * sum(int(s["a2a_bytes"]) for s in stats)
        if trainer.global_step != self._step_seen and self._current is not None:  # an optimizer step ended
            self._step_seen = trainer.global_step
            self._pending.append(self._current)
            self._current = None
            if len(self._pending) >= self.flush_every_n_steps:
                self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._host.append(torch.stack(self._pending).cpu())  # the one host read per interval
            self._pending = []

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._layers:
            return
        self._flush()
        steps = torch.cat(self._host) if self._host else torch.zeros(0, len(self._layers), 1)
        totals = torch.tensor([float(self._a2a_bytes), float(len(steps))], dtype=torch.float64)
        # a pipeline's ranks hold different layers: each reports its own; else the counts are summed over
        # the data-parallel ranks (ranks of one replica, e.g. tensor-parallel ones, saw the same tokens)
        if trainer.world_size > 1 and getattr(trainer.strategy, "pipeline", None) is None:
            dp = int((getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1))
            steps = trainer.strategy.reduce(steps.to(pl_module.device, torch.float64), reduce_op="sum").cpu()
            steps = steps * (dp / trainer.world_size)
            totals = trainer.strategy.reduce(totals.to(pl_module.device), reduce_op="mean").cpu()
        self._summary = summarize(steps.to(torch.float64), a2a_bytes=float(totals[0]), n_steps=int(totals[1]))

    def summary(self) -> dict[str, Any]:
        return {"moe": self._summary} if self._summary else {}


def summarize(steps: torch.Tensor, *, a2a_bytes: float, n_steps: int) -> dict[str, Any]:
    """The ``moe`` summary from (steps, layers, experts + 1) global counts (last column: dropped)."""
    counts, dropped = steps[..., :-1], steps[..., -1]
    routed = counts.sum((1, 2))
    balance = (counts.amax(-1) / counts.mean(-1).clamp_min(1e-12)).amax(-1) if counts.numel() else counts.new_zeros(0)
    total = float(routed.sum() + dropped.sum())
    return {
        "n_layers": int(steps.shape[1]),
        "n_experts": int(counts.shape[-1]),
        "tokens_per_expert": counts.round().long().tolist(),
        "load_balance_max_over_mean": [round(float(b), 4) for b in balance],
        "load_balance_max_over_mean_mean": float(balance.mean()) if balance.numel() else None,
        "dropped_fraction": float(dropped.sum()) / total if total else 0.0,
        "all_to_all_bytes_per_step": a2a_bytes / n_steps if n_steps else 0.0,
    }
