"""MoE measurements: tokens per expert per step, load balance, dropped tokens, all-to-all bytes.

Every MoE layer sums the figures of its forwards in ``last_stats`` (``parallel/contract.py``'s
``ForwardStatsSource``; device tensors: routed assignments per expert, dropped assignments; the
all-to-all bytes as a Python int, which the dispatcher knows on the host anyway) -- one forward per
batch, or a pipeline's micro-batches; never an eval or ``no_grad`` forward, nor an activation
checkpoint's recompute (``models.moe.is_training_forward``). The MoE layers (``moe_layers``, named
by their module paths in the LightningModule) are our own ``MoE`` layers and the experts modules of a
Hugging Face MoE model (Mixtral, Qwen2/3-MoE, ...: ``hf.plan.hf_experts``), to which this callback
attaches ``HFExpertCounts`` for the run. After each training batch this callback adds them to a
device buffer of the current optimizer step and clears them -- no host read, no collective. Every
``flush_every_n_steps`` steps the finished steps are moved to the host (one read per interval),
and at the end of training one all-gather brings every rank's counts together by layer: summed
over the data-parallel ranks, so the figures are those of the global batch, and the layers of a
pipeline's stages put back in model order. A model without MoE layers: nothing happens (no
collective) and ``summary()`` is empty.

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
from torch import nn

from lightning_par.callbacks.memory import all_gather_objects
from lightning_par.models.moe import MoE, is_training_forward
from lightning_par.parallel.contract import STATS_ATTR, ForwardStatsSource
from lightning_par.parallel.hf.plan import declares_experts, find_hf_model, hf_experts


class HFExpertCounts:
    """``MoE``'s figures (a ``ForwardStatsSource``) for a Hugging Face experts module, which is called as
    ``experts(hidden_states, top_k_index, top_k_weights)``: a forward hook sums each training forward's
    assignments per expert (device tensors, no host read) and the all-to-all bytes that the
    expert-parallel forward leaves in ``last_a2a_bytes`` (``parallel/hf/experts.py``; 0 without).
    These models are dropless: nothing is dropped. Attached as the module's ``STATS_ATTR`` (where a
    pipeline finds it) until ``detach``."""

    def __init__(self, module: nn.Module, n_experts: int) -> None:
        self.module, self.n_experts = module, n_experts
        self._forwards: list[tuple[torch.Tensor, int, int]] = []  # counts per expert, assignments, a2a bytes
        self._hook = module.register_forward_hook(self._record, with_kwargs=True)
        setattr(module, STATS_ATTR, self)

    def _record(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        if not isinstance(index, torch.Tensor) or index.is_meta or not is_training_forward(module):
            return
        n, flat = self.n_experts, index.reshape(-1).long()
        # a scatter, not torch.bincount (on CUDA that reads the indices' min and max on the host); an
        # index outside [0, n) routes to no expert (transformers' sentinel is n) and is not counted
        bucket = torch.where((flat >= 0) & (flat < n), flat, n)
        counts = torch.zeros(n + 1, dtype=torch.long, device=flat.device).index_add_(0, bucket, torch.ones_like(bucket))
        self._forwards.append((counts[:n], flat.numel(), int(getattr(module, "last_a2a_bytes", 0))))

    @property
    def last_stats(self) -> dict[str, Any]:
        """As ``MoE.last_stats``: the forwards since ``clear_stats``, summed; {} when there was none."""
        if not self._forwards:
            return {}
        counts, assignments, a2a = zip(*self._forwards)
        tokens = torch.stack(counts).sum(0)
        return {"tokens_per_expert": tokens, "dropped": tokens.new_zeros(()), "assignments": sum(assignments),
                "a2a_bytes": sum(a2a)}

    def clear_stats(self) -> None:
        self._forwards = []

    def keep_last_forwards(self, n: int) -> None:
        self._forwards = self._forwards[-n:] if n else []

    def detach(self) -> None:
        self._hook.remove()
        if getattr(self.module, STATS_ATTR, None) is self:
            delattr(self.module, STATS_ATTR)


def moe_layers(pl_module: nn.Module) -> list[tuple[str, ForwardStatsSource]]:
    """The MoE layers of ``pl_module`` by module path: its ``MoE`` layers, and the experts modules of
    the Hugging Face model it holds (``HFExpertCounts`` attached to those that have none yet)."""
    layers: list[tuple[str, ForwardStatsSource]] = [(n, m) for n, m in pl_module.named_modules() if isinstance(m, MoE)]
    found = find_hf_model(pl_module)
    if found is not None:
        prefix, hf = found
        paths, n_experts = hf_experts(hf)  # under a pipeline: those of this rank's stages
        for path in paths:
            mod = hf.get_submodule(path)
            counts = getattr(mod, STATS_ATTR, None) or HFExpertCounts(mod, n_experts)
            layers.append((f"{prefix}.{path}" if prefix else path, counts))
    return layers


class MoEMonitor(L.Callback):
    def __init__(self, flush_every_n_steps: int = 50) -> None:
        if isinstance(flush_every_n_steps, bool) or not isinstance(flush_every_n_steps, int) or flush_every_n_steps < 1:
            raise ValueError(f"MoEMonitor: flush_every_n_steps={flush_every_n_steps!r} must be an integer >= 1")
        self.flush_every_n_steps = flush_every_n_steps
        self._layers: list[ForwardStatsSource] = []
        self._names: list[str] = []
        self._current: torch.Tensor | None = None  # (layers, experts + 1): counts, then dropped
        self._pending: list[torch.Tensor] = []  # finished steps still on the device
        self._host: list[torch.Tensor] = []
        self._a2a_bytes = 0
        self._step_seen = 0
        self._summary: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        layers = moe_layers(pl_module)
        self._names, self._layers = [n for n, _ in layers], [m for _, m in layers]
        # the same on every rank (a pipeline rank may hold no MoE layer, but joins the gather at the end)
        hf = find_hf_model(pl_module)
        self._moe_model = (bool(self._layers) or getattr(getattr(pl_module, "config", None), "n_experts", 0) > 0
                           or (hf is not None and declares_experts(hf[1])))
        self._step_seen = trainer.global_step
        for m in self._layers:
            m.clear_stats()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._layers:
            return
        stats = [m.last_stats for m in self._layers]
        if all(stats):
            row = torch.stack([torch.cat([s["tokens_per_expert"], s["dropped"].reshape(1)]) for s in stats])
            self._current = row if self._current is None else self._current + row
            self._a2a_bytes += sum(int(s["a2a_bytes"]) for s in stats)  # forward and backward (EPDispatch)
        for m in self._layers:  # the layers keep their forwards (a pipeline's micro-batches) until read
            m.clear_stats()
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
        for m in self._layers:  # the hooks of this run end with it
            if isinstance(m, HFExpertCounts):
                m.detach()
        if not getattr(self, "_moe_model", False):
            return
        self._flush()
        steps = torch.cat(self._host) if self._host else torch.zeros(0, len(self._layers), 1)
        # one gather at the end: every rank's per-step counts of the layers it holds, by layer name. A
        # layer's counts are summed over the data-parallel ranks and divided by the ranks of one replica
        # that hold it (tensor-parallel ranks see the same tokens); a pipeline's ranks hold different
        # layers, put back in model order
        mine = (self._names, steps.to(torch.float64), float(self._a2a_bytes))
        gathered = all_gather_objects(mine) if trainer.world_size > 1 else [mine]
        if not any(names for names, _, _ in gathered):
            return
        dp = int((getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1))
        sums: dict[str, torch.Tensor] = {}
        holders: dict[str, int] = {}
        for names, per_step, _ in gathered:
            for i, name in enumerate(names):
                sums[name] = per_step[:, i] + sums[name] if name in sums else per_step[:, i]
                holders[name] = holders.get(name, 0) + 1
        order = sorted(sums, key=lambda n: [int(t) if t.isdigit() else 0 for t in n.split(".")])
        per_layer = [sums[n] * (dp / holders[n]) for n in order]
        counts = torch.stack(per_layer, dim=1)  # (steps, layers, experts + 1)
        a2a = sum(b for _, _, b in gathered) / len(gathered)
        self._summary = summarize(counts, a2a_bytes=a2a, n_steps=int(counts.shape[0]))

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
