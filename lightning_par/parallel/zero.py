"""ZeRO stages 1 and 2 over a data-parallel process group (Rajbhandari et al. 2020).

With N data-parallel ranks, plain DDP keeps on every rank the full parameters (Ψ elements), the
full gradients (Ψ) and the full optimizer state (Adam: m and v, 2Ψ) -- N identical copies.
ZeRO removes the redundancy by giving each rank one contiguous 1/N of the work:

- stage 1 (P_os): optimizer state sharded. Gradients are still all-reduced in full (by DDP);
  each rank updates only the parameters it owns, then the updated parameters are broadcast.
  torch ships this as ``ZeroRedundancyOptimizer``; ``make_zero1_optimizer`` builds one.
- stage 2 (P_os+g): gradients sharded too. An all-reduce is a reduce-scatter followed by an
  all-gather; stage 2 stops after the reduce-scatter, so each rank only ever holds the *reduced*
  gradient of its own shard, updates its shard, and all-gathers *parameters* instead of
  gradients. Same communication volume as DDP (2Ψ per step), 1/N of the gradient and optimizer
  memory. torch has no stage 2, so ``Zero2Optimizer`` implements it.

Stage 3 (parameters sharded too) is FSDP: see ``lightning_par.parallel.fsdp``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from lightning_par import ConfigError

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor (the old names warn)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def _constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (AdamW's ``defaults`` holds
    ``decoupled_weight_decay``, which ``AdamW(...)`` refuses)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def make_zero1_optimizer(optimizer: torch.optim.Optimizer, *, process_group=None) -> ZeroRedundancyOptimizer:
    """Rebuild ``optimizer`` (same class, same param groups and hyperparameters) as ZeRO stage 1.

    Build it before the first step: existing optimizer state is not carried over. Gradients must
    already be averaged over the data-parallel group when ``step()`` runs (wrap the model in DDP).
    """
    groups = [{**_hyperparameters(g), "params": list(g["params"])} for g in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=process_group,
                                   **_constructor_kwargs(optimizer))


class Zero2Optimizer(torch.optim.Optimizer):
    """ZeRO stage 2: optimizer state and gradients sharded over the data-parallel group.

    Layout: the optimizer's parameters, in param-group order, are re-pointed (``p.data = view``)
    into ONE flat buffer (fp32: Lightning's mixed precision autocasts, so no master copy is needed)
    of ``P = ceil(Ψ / N) * N`` elements (zero padding at the end; ``S`` is also rounded up to a multiple
    of the inner optimizer's ``block_size`` when it has one, e.g. torchao's 8-bit AdamW). Rank
    ``r`` owns ``flat[r*S:(r+1)*S]`` with ``S = P / N``. Parameters stay full and replicated.

    ``step()`` runs after backward, on the *local, un-reduced* gradients (do not wrap the model in
    DDP), and does, with ``g_i`` the gradient of rank i::

        full   = flatten(p.grad for p)              # this rank's local gradient, P elements
        shard  = reduce_scatter(full) / N           # = (1/N) Σ_i g_i[r*S:(r+1)*S]
        p.grad = None                               # only the S-element shard survives
        inner.step()                                # e.g. AdamW on flat[r*S:(r+1)*S] in place
        flat   = all_gather(flat[r*S:(r+1)*S])      # every rank's full parameters updated

    The inner optimizer (same class and hyperparameters as the one given) sees one tensor per
    param group: the intersection of the rank's shard with the group's range (possibly empty), a
    *view* of ``flat``, so its in-place update writes the parameters directly and its state (m, v)
    has S elements in total. The gradient shard is a persistent S-element buffer ``grad_shard``.

    ``param_groups`` are the original groups (real model parameters, read by Lightning and LR
    schedulers); their hyperparameters are copied to the inner groups at every step.
    ``state`` is the inner (sharded) state. ``max_grad_norm`` clips by the global norm of the
    *reduced* gradient (clipping local grads before the reduction would be wrong).

    Limits: one dtype and device for all parameters; no sparse gradients; the full ``.grad``s
    exist between backward and ``step()`` (DeepSpeed reduces bucket by bucket during backward).
    A parameter without gradient on *some* ranks is right (its gradient there is zero, as the
    samples' share of it is); one without gradient on *every* rank in a step (unused, or in a branch
    not taken that step) is refused: torch's optimizers skip it, but the inner optimizer steps the
    whole flat shard and would move it (momentum, weight decay) and count the step for it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module, *, process_group=None,
                 max_grad_norm: float | None = None) -> None:
        names = {p: n for n, p in module.named_parameters()}
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        missing = [tuple(p.shape) for p in self._params if p not in names]
        if missing:
            raise ValueError(f"Zero2Optimizer: optimizer parameters of shapes {missing} are not in the module")
        if len({(p.dtype, p.device) for p in self._params}) != 1:
            raise ValueError("Zero2Optimizer: all parameters must share one dtype and device")
        self._fqns = [names[p] for p in self._params]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self.last_grad_norm: torch.Tensor | None = None
        self.max_grad_norm = max_grad_norm
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self._offsets, total = [], 0
        for p in self._params:
            self._offsets.append(total)
            total += p.numel()
        n = self.world_size
        # a block-quantised inner optimizer (torchao's AdamW8bit: one scale per ``block_size`` elements)
        # quantises only tensors whose size is a multiple of its block: round the shard up to one
        block = int(getattr(optimizer, "block_size", 1))
        self.shard_size = S = -(-total // (n * block)) * block
        padded = S * n
        first = self._params[0]
        # 1. one flat buffer; every parameter becomes a view of it (identical on every rank)
        self.flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, off in zip(self._params, self._offsets):
                self.flat[off:off + p.numel()].copy_(p.reshape(-1))
                p.data = self.flat[off:off + p.numel()].view_as(p)
        dist.broadcast(self.flat, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        # 2. this rank's shard, cut per param group: group g covers [start_g, end_g) of flat
        self.grad_shard = torch.zeros(S, dtype=first.dtype, device=first.device)
        lo_r, hi_r = self.rank * S, (self.rank + 1) * S
        self._views, self._ranges, inner_groups, start = [], [], [], 0
        for i, g in enumerate(optimizer.param_groups):
            end = padded if i == len(optimizer.param_groups) - 1 else start + sum(p.numel() for p in g["params"])
            lo, hi = max(start, lo_r), min(end, hi_r)
            hi = max(lo, hi)  # empty when the group lies outside this rank's shard
            view = self.flat[lo:hi]
            view.grad = self.grad_shard[lo - lo_r:hi - lo_r]
            self._views.append(view)
            self._ranges.append((lo, hi))
            inner_groups.append({**_hyperparameters(g), "params": [view]})
            start = end
        self.inner = type(optimizer)(inner_groups, **_constructor_kwargs(optimizer))
        super().__init__([{**_hyperparameters(g), "params": list(g["params"])} for g in optimizer.param_groups],
                         optimizer.defaults)
        self.state = self.inner.state  # what this rank really holds: the sharded state

    # --- training ------------------------------------------------------------------------------
    def _push_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update(_hyperparameters(outer))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - see the class docstring
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._push_hyperparameters()
        has = torch.tensor([p.grad is not None for p in self._params], dtype=torch.float32, device=self.flat.device)
        full = torch.zeros_like(self.flat)  # temporary: this rank's un-reduced gradient
        for p, off in zip(self._params, self._offsets):
            if p.grad is not None:
                full[off:off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        _reduce_scatter(self.grad_shard, full, op=dist.ReduceOp.SUM, group=self.process_group)
        del full
        self.grad_shard.div_(self.world_size)  # SUM then divide: gloo has no AVG
        # One small all-reduce per step carries both the per-parameter "got a gradient" counts and,
        # when clipping, the squared norm of this rank's shard: one collective, not two.
        counts = torch.cat([has, self.grad_shard.float().pow(2).sum().reshape(1)]) \
            if self.max_grad_norm is not None else has
        dist.all_reduce(counts, group=self.process_group)
        self._refuse_globally_unused(counts[:len(self._params)])
        if self.max_grad_norm is not None:
            self.last_grad_norm = counts[-1].sqrt()
            self.grad_shard.mul_(torch.clamp(self.max_grad_norm / (self.last_grad_norm + 1e-6), max=1.0))
        self.inner.step()
        lo_r = self.rank * self.shard_size
        mine = self.flat[lo_r:lo_r + self.shard_size].clone()  # gathering into its own input is unsafe
        _all_gather(self.flat, mine, group=self.process_group)
        return loss

    def _refuse_globally_unused(self, has: torch.Tensor) -> None:
        """Stop, in one line on every rank, when a parameter got a gradient on no rank (``has``: ranks that
        gave one, per parameter). Skipping it exactly would need per-parameter optimizer steps (Adam's
        step count is one per inner tensor); DistributedDataParallel without find_unused_parameters
        stops on the same models."""
        unused = [self._fqns[i] for i in (has == 0).nonzero().flatten().tolist()]
        if unused:
            shown = ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else "")
            raise ConfigError(f"zero2: parameter(s) {shown} got no gradient on any rank in a training step (unused, "
                              "or in a branch not taken every step), which zero2's flat optimizer shard cannot skip "
                              "as torch's optimizers do; use zero3 or fsdp, or zero1 / ddp with "
                              "find_unused_parameters=True")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.grad_shard.zero_()

    # --- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state (no communication); load with the same world size."""
        sd = self.inner.state_dict()
        sd["zero2"] = {"world_size": self.world_size, "rank": self.rank, "numel": self.flat.numel()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        meta = sd.pop("zero2", None)
        mine = {"world_size": self.world_size, "rank": self.rank, "numel": self.flat.numel()}
        if meta != mine:
            raise ValueError(f"Zero2Optimizer: sharded state of {meta} cannot load into {mine}; "
                             "use full_state_dict()/load_full_state_dict() to change world size")
        self.inner.load_state_dict(sd)
        self.state = self.inner.state
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            outer.update(_hyperparameters(inner))

    def full_state_dict(self) -> dict[str, Any]:
        """Canonical torch layout keyed by parameter FQN (collective: every rank must call it).

        Per-element state (Adam's ``exp_avg``, ``exp_avg_sq``) is all-gathered from the shards
        into one flat tensor and cut back into parameter shapes; scalars (``step``) are copied.
        The same layout as ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(...,
        options=StateDictOptions(full_state_dict=True))``, so a run can resume under any strategy.
        """
        groups = [{**_hyperparameters(g), "params": [self._fqns[self._index[id(p)]] for p in g["params"]]}
                  for g in self.param_groups]
        per_elem, scalars_by_group = [], []
        for view in self._views:
            s = self.inner.state.get(view, {})
            per_elem = per_elem or [k for k, t in s.items() if torch.is_tensor(t) and t.shape == view.shape]
            scalars_by_group.append({k: v for k, v in s.items() if not (torch.is_tensor(v) and v.shape == view.shape)})
        gathered = {}
        for key in per_elem:
            local = torch.cat([self.inner.state[v][key].reshape(-1) for v in self._views])
            gathered[key] = torch.empty(self.flat.numel(), dtype=local.dtype, device=local.device)
            _all_gather(gathered[key], local, group=self.process_group)
        state: dict[str, dict[str, Any]] = {}
        if per_elem:
            for gi, g in enumerate(self.param_groups):
                for p in g["params"]:
                    i = self._index[id(p)]
                    entry = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars_by_group[gi].items()}
                    for key, full in gathered.items():
                        entry[key] = full[self._offsets[i]:self._offsets[i] + p.numel()].view_as(p).clone()
                    state[self._fqns[i]] = entry
        return {"state": state, "param_groups": groups}

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the canonical FQN-keyed layout (from ``full_state_dict`` or any other strategy's
        full optimizer state): every rank keeps only its slice. No communication."""
        full_state, groups = state_dict["state"], state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"Zero2Optimizer: checkpoint has {len(groups)} param groups, optimizer has "
                             f"{len(self.param_groups)}")
        for outer, loaded in zip(self.param_groups, groups):
            outer.update(_hyperparameters(loaded))
        self._push_hyperparameters()
        self.inner.state.clear()
        if not full_state:
            return
        absent = [f for f in self._fqns if f not in full_state]
        if absent:
            raise ValueError(f"Zero2Optimizer: optimizer state missing for {absent[:3]}")
        first = full_state[self._fqns[0]]
        per_elem = [k for k, v in first.items()
                    if torch.is_tensor(v) and v.shape == self._params[0].shape and k != "step"]
        flats = {k: torch.zeros_like(self.flat) for k in per_elem}
        for p, fqn, off in zip(self._params, self._fqns, self._offsets):
            for k in per_elem:
                flats[k][off:off + p.numel()].copy_(full_state[fqn][k].reshape(-1))
        for gi, (view, (lo, hi)) in enumerate(zip(self._views, self._ranges)):
            source = full_state[self._fqns[self._index[id(self.param_groups[gi]["params"][0])]]]
            entry = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in source.items() if k not in per_elem}
            entry.update({k: flats[k][lo:hi].clone() for k in per_elem})
            self.inner.state[view] = entry
