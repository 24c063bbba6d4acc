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

Stage 3 (parameters sharded too) is FSDP: see ``lightning_par.parallel.sharding.fsdp``.
"""

from __future__ import annotations

import functools
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


#: how Zero2Optimizer reduces and gathers: reduce-scatter + all-gather (NCCL's ring collectives, half
#: an all-reduce each), or all-reduce + one broadcast per chunk: the same bytes in gloo's faster
#: collectives (2 CPU ranks, 64 MB: all-reduce 43 ms against reduce-scatter 77 ms; broadcast 15 ms
#: against all-gather 51 ms; ``python -m lightning_par.tools.collectives``)
COLLECTIVES = ("reduce_scatter", "all_reduce")


class _Bucket:
    """Consecutive parameters whose gradients are reduce-scattered together: ``flat[start:start + n*chunk]``,
    rank r owning ``flat[start + r*chunk : start + (r+1)*chunk]`` and ``grad_shard[shard_off : shard_off + chunk]``."""

    __slots__ = ("start", "chunk", "shard_off", "params", "staging", "ready")

    def __init__(self, start: int, chunk: int, shard_off: int, params: list[int]) -> None:
        self.start, self.chunk, self.shard_off, self.params = start, chunk, shard_off, params
        self.staging: torch.Tensor | None = None  # this rank's local gradients of the bucket, while it fills
        self.ready: set[int] = set()  # parameters whose gradient this backward has delivered


class Zero2Optimizer(torch.optim.Optimizer):
    """ZeRO stage 2: optimizer state and gradients sharded over the data-parallel group, gradients
    reduce-scattered in buckets from backward hooks as they become ready (DeepSpeed's stage 2), so
    the full set of gradients never exists at once.

    Layout: the optimizer's parameters, in param-group order, are re-pointed (``p.data = view``) into
    ONE flat buffer (fp32 under Lightning's mixed precision: autocast, no master copy needed), cut
    into buckets of consecutive parameters of at most ``bucket_cap_mb`` (a larger parameter is a
    bucket of its own). Each bucket is padded to ``n * chunk`` elements (``chunk`` rounded up to the
    inner optimizer's ``block_size`` when it has one, e.g. torchao's 8-bit AdamW); rank ``r`` owns the
    r-th chunk of every bucket. Parameters stay full and replicated.

    Backward (the model is not wrapped in DDP): each parameter's post-accumulate-grad hook adds its
    local gradient into its bucket's staging buffer and frees ``p.grad``. Buckets are reduce-scattered
    (asynchronously, at most ``in_flight`` at a time) in one fixed order -- last bucket first, as
    backward produces them -- each as soon as it and every bucket before it in that order are full;
    at the end of backward (an autograd-engine callback) the rest follow in the same order, a
    parameter without gradient on this rank counting zeros. Every rank thus issues the same
    collectives in the same order whatever its data. Each reduced chunk is divided by ``n`` and added
    into ``grad_shard``: with gradient accumulation every micro-batch reduce-scatters (as DeepSpeed),
    and the shard accumulates. ``step()``::

        inner.step()                       # e.g. AdamW on this rank's chunks of flat, in place
        flat = all_gather(chunks)          # per bucket: every rank's parameters updated

    ``collectives``: ``"reduce_scatter"`` (reduce-scatter each bucket, all-gather the parameters) or
    ``"all_reduce"`` (all-reduce each bucket in place and keep this rank's chunk; each owner broadcasts
    its chunk): the same payload, in the collectives gloo runs fastest (see ``COLLECTIVES``).

    The inner optimizer (same class and hyperparameters as the one given) sees, per param group, the
    views of ``flat`` where this rank's chunks meet the group's range (a zero-size view when none
    do); each view's ``.grad`` is the matching slice of ``grad_shard``, so its state (m, v) has ``S =
    Σ chunk`` elements in total.

    ``param_groups`` are the original groups (real model parameters, read by Lightning and LR
    schedulers); their hyperparameters are copied to the inner groups at every step.
    ``state`` is the inner (sharded) state. ``max_grad_norm`` clips by the global norm of the
    *reduced* gradient (clipping local grads before the reduction would be wrong). The model
    parameters' ``.grad`` are None after backward: what exists is the reduced shard.

    Limits: one dtype and device for all parameters; no sparse gradients; no loss scaling (fp16's
    GradScaler reads ``.grad``). A parameter without gradient on *some* ranks is right (its gradient
    there is zero, as the samples' share of it is); one without gradient on *every* rank in a step
    (unused, or in a branch not taken that step) is refused: torch's optimizers skip it, but the
    inner optimizer steps the whole shard and would move it (momentum, weight decay) and count the
    step for it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module, *, process_group=None,
                 max_grad_norm: float | None = None, bucket_cap_mb: float = 25.0, in_flight: int = 2,
                 collectives: str = "reduce_scatter", name: str = "zero2") -> None:
        names = {p: n for n, p in module.named_parameters()}
        self.name = name  # what its one-line stops start with: the strategy's name (lp_zero2) under lightning_par
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        missing = [tuple(p.shape) for p in self._params if p not in names]
        if missing:
            raise ValueError(f"Zero2Optimizer: optimizer parameters of shapes {missing} are not in the module")
        if len({(p.dtype, p.device) for p in self._params}) != 1:
            raise ValueError("Zero2Optimizer: all parameters must share one dtype and device")
        if not bucket_cap_mb > 0 or in_flight < 1:
            raise ValueError(f"Zero2Optimizer: bucket_cap_mb must be > 0 and in_flight >= 1, got "
                             f"{bucket_cap_mb} and {in_flight}")
        if collectives not in COLLECTIVES:
            raise ValueError(f"Zero2Optimizer: collectives must be one of {COLLECTIVES}, got {collectives!r}")
        self.collectives = collectives
        self._fqns = [names[p] for p in self._params]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self.last_grad_norm: torch.Tensor | None = None
        self.max_grad_norm = max_grad_norm
        self.in_flight = in_flight
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = n = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        first = self._params[0]
        self._buckets, self._offsets = self._layout(int(getattr(optimizer, "block_size", 1)),
                                                    max(1, int(bucket_cap_mb * 2**20) // first.element_size()))
        self._bucket_of = [0] * len(self._params)
        for k, b in enumerate(self._buckets):
            for i in b.params:
                self._bucket_of[i] = k
        padded = self._buckets[-1].start + n * self._buckets[-1].chunk
        self.shard_size = sum(b.chunk for b in self._buckets)
        # 1. one flat buffer; every parameter becomes a view of it (identical on every rank)
        self.flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, off in zip(self._params, self._offsets):
                self.flat[off:off + p.numel()].copy_(p.reshape(-1))
                p.data = self.flat[off:off + p.numel()].view_as(p)
        dist.broadcast(self.flat, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        # 2. this rank's chunks, cut per param group: group g covers [bounds[g], bounds[g+1]) of flat
        self.grad_shard = torch.zeros(self.shard_size, dtype=first.dtype, device=first.device)
        starts = [self._offsets[self._index[id(g["params"][0])]] for g in optimizer.param_groups]
        bounds = [0, *starts[1:], padded]
        per_group: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
        self._views: list[torch.Tensor] = []  # in shard order (bucket, then group): the state's layout
        self._ranges: list[tuple[int, int]] = []
        for b in self._buckets:
            lo_r = b.start + self.rank * b.chunk
            for gi in range(len(per_group)):
                lo, hi = max(bounds[gi], lo_r), min(bounds[gi + 1], lo_r + b.chunk)
                if hi > lo:
                    self._add_view(per_group[gi], lo, hi, b.shard_off + lo - lo_r)
        for views in per_group:
            if not views:  # a group with nothing on this rank still steps (an empty tensor)
                self._add_view(views, 0, 0, 0)
        inner_groups = [{**_hyperparameters(g), "params": views} for g, views in zip(optimizer.param_groups, per_group)]
        self.inner = type(optimizer)(inner_groups, **_constructor_kwargs(optimizer))
        super().__init__([{**_hyperparameters(g), "params": list(g["params"])} for g in optimizer.param_groups],
                         optimizer.defaults)
        self.state = self.inner.state  # what this rank really holds: the sharded state
        # 3. backward hooks
        self._has = torch.zeros(len(self._params), dtype=torch.float32, device=first.device)
        self._next = len(self._buckets) - 1  # the next bucket to launch (last first)
        self._pending: list[tuple[_Bucket, torch.Tensor, Any]] = []
        self._armed = False
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                       for i, p in enumerate(self._params)]

    def _layout(self, block: int, cap: int) -> tuple[list[_Bucket], list[int]]:
        """Buckets of consecutive parameters (at most ``cap`` elements, or one larger parameter) and each
        parameter's offset in the flat buffer."""
        groups: list[list[int]] = [[]]
        size = 0
        for i, p in enumerate(self._params):
            if groups[-1] and size + p.numel() > cap:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += p.numel()
        buckets, offsets, start, shard_off = [], [0] * len(self._params), 0, 0
        for idx in groups:
            off = start
            for i in idx:
                offsets[i] = off
                off += self._params[i].numel()
            chunk = -(-(off - start) // (self.world_size * block)) * block
            buckets.append(_Bucket(start, chunk, shard_off, idx))
            start += chunk * self.world_size
            shard_off += chunk
        return buckets, offsets

    def _add_view(self, views: list[torch.Tensor], lo: int, hi: int, shard_lo: int) -> None:
        view = self.flat[lo:hi]
        view.grad = self.grad_shard[shard_lo:shard_lo + hi - lo]
        views.append(view)
        self._views.append(view)
        self._ranges.append((lo, hi))

    # --- backward: bucketed reduce-scatter -----------------------------------------------------
    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        if not self._armed:  # first gradient of this backward: flush what is left when it ends
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._armed = True
        k = self._bucket_of[i]
        b = self._buckets[k]
        if k > self._next or i in b.ready:
            raise RuntimeError(f"{self.name}: {self._fqns[i]} received a second gradient in one backward, after it was "
                               "staged for its bucket's reduce-scatter (reentrant checkpointing?)")
        if b.staging is None:
            b.staging = torch.zeros(self.world_size * b.chunk, dtype=self.flat.dtype, device=self.flat.device)
        off = self._offsets[i] - b.start
        b.staging[off:off + param.numel()].copy_(param.grad.reshape(-1))
        param.grad = None
        b.ready.add(i)
        self._has[i] = 1
        while self._next >= 0 and len(self._buckets[self._next].ready) == len(self._buckets[self._next].params):
            self._launch(self._buckets[self._next])

    def _launch(self, b: _Bucket) -> None:
        if b.staging is None:  # nothing of it arrived on this rank: its share is zeros
            b.staging = torch.zeros(self.world_size * b.chunk, dtype=self.flat.dtype, device=self.flat.device)
        if self.collectives == "all_reduce":  # in place; this rank then keeps its chunk of the sum
            out = b.staging[self.rank * b.chunk:(self.rank + 1) * b.chunk]
            work = dist.all_reduce(b.staging, group=self.process_group, async_op=True)
        else:
            out = torch.empty(b.chunk, dtype=self.flat.dtype, device=self.flat.device)
            work = _reduce_scatter(out, b.staging, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
        self._pending.append((b, out, work))
        self._next -= 1
        while len(self._pending) > self.in_flight:
            self._complete(self._pending.pop(0))

    def _complete(self, item: tuple[_Bucket, torch.Tensor, Any]) -> None:
        b, out, work = item
        work.wait()
        out.div_(self.world_size)  # SUM then divide: gloo has no AVG
        self.grad_shard[b.shard_off:b.shard_off + b.chunk].add_(out)
        b.staging = None
        b.ready.clear()

    def _finish_backward(self) -> None:
        while self._next >= 0:
            self._launch(self._buckets[self._next])
        while self._pending:
            self._complete(self._pending.pop(0))
        self._next = len(self._buckets) - 1
        self._armed = False

    def remove_hooks(self) -> None:
        """Detach the backward hooks (the strategy's teardown): the parameters outlive the optimizer."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

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
        if self._pending or self._armed:
            raise RuntimeError(f"{self.name}: step() while a backward's reduce-scatters are unfinished")
        stray = [self._fqns[i] for i, p in enumerate(self._params) if p.grad is not None]
        if stray:  # set outside backward: no hook staged them, and stepping would silently ignore them
            raise RuntimeError(f"{self.name}: {', '.join(stray[:3])} hold a .grad set outside backward; zero2 reduces "
                               "gradients only from backward's hooks")
        self._push_hyperparameters()
        # One small all-reduce per step carries both the per-parameter "got a gradient" counts and,
        # when clipping, the squared norm of this rank's shard: one collective, not two.
        counts = torch.cat([self._has, self.grad_shard.float().pow(2).sum().reshape(1)]) \
            if self.max_grad_norm is not None else self._has.clone()
        dist.all_reduce(counts, group=self.process_group)
        self._refuse_globally_unused(counts[:len(self._params)])
        if self.max_grad_norm is not None:
            self.last_grad_norm = counts[-1].sqrt()
            self.grad_shard.mul_(torch.clamp(self.max_grad_norm / (self.last_grad_norm + 1e-6), max=1.0))
        self.inner.step()
        self._gather_parameters()
        return loss

    @torch.no_grad()
    def initialize_state(self) -> None:
        """Create the inner optimizer's lazily built state (a checkpoint needs tensors to load into): one
        inner step on zero gradients with lr 0, which leaves the parameters as they are. No collective."""
        if self.inner.state:
            return
        self.grad_shard.zero_()
        lrs = [g["lr"] for g in self.inner.param_groups]
        for g in self.inner.param_groups:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        self.inner.step()
        for g, lr in zip(self.inner.param_groups, lrs):
            g["lr"] = lr

    def _gather_parameters(self) -> None:
        """Every rank's updated chunks to every rank, bucket by bucket, at most ``in_flight`` buckets
        at a time: all-gathers (each chunk copied out first: gathering into its own input is unsafe),
        or with ``collectives="all_reduce"`` one in-place broadcast per chunk from its owner."""
        n, pending = self.world_size, []
        for b in self._buckets:
            if self.collectives == "all_reduce":
                for r in range(n):
                    chunk = self.flat[b.start + r * b.chunk:b.start + (r + 1) * b.chunk]
                    pending.append((chunk, dist.broadcast(chunk, src=dist.get_global_rank(self.process_group, r),
                                                          group=self.process_group, async_op=True)))
            else:
                mine = self.flat[b.start + self.rank * b.chunk:b.start + (self.rank + 1) * b.chunk].clone()
                pending.append((mine, _all_gather(self.flat[b.start:b.start + n * b.chunk], mine,
                                                  group=self.process_group, async_op=True)))
            while len(pending) > self.in_flight * (n if self.collectives == "all_reduce" else 1):
                pending.pop(0)[1].wait()
        for _, work in pending:
            work.wait()

    def _refuse_globally_unused(self, has: torch.Tensor) -> None:
        """Stop, in one line on every rank, when a parameter got a gradient on no rank (``has``: ranks that
        gave one, per parameter). Skipping it exactly would need per-parameter optimizer steps (Adam's
        step count is one per inner tensor); DistributedDataParallel without find_unused_parameters
        stops on the same models."""
        unused = [self._fqns[i] for i in (has == 0).nonzero().flatten().tolist()]
        if unused:
            shown = ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else "")
            raise ConfigError(f"{self.name}: parameter(s) {shown} got no gradient on any rank in a training step "
                              "(unused, or in a branch not taken every step), which zero2's flat optimizer shard "
                              "cannot skip as torch's optimizers do; use zero3 or fsdp, or zero1 / ddp with "
                              "find_unused_parameters=True")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new accumulation: the reduced shard and the "got a gradient" flags are zeroed (the
        parameters' ``.grad`` are already None: the hooks free them)."""
        for p in self._params:
            p.grad = None
        self.grad_shard.zero_()
        self._has.zero_()

    # --- checkpoints ---------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "rank": self.rank, "numel": self.flat.numel(),
                "chunks": [b.chunk for b in self._buckets]}

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state (no communication); load with the same world size and buckets."""
        sd = self.inner.state_dict()
        sd["zero2"] = self._meta()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        meta = sd.pop("zero2", None)
        if meta != self._meta():
            raise ValueError(f"Zero2Optimizer: sharded state of {meta} cannot load into {self._meta()}; "
                             "use full_state_dict()/load_full_state_dict() to change world size or buckets")
        self.inner.load_state_dict(sd)
        self.state = self.inner.state
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            outer.update(_hyperparameters(inner))

    def _gather_flat(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's chunks of a shard-ordered tensor (``S`` elements) gathered into the flat order."""
        full = torch.empty(self.flat.numel(), dtype=local.dtype, device=local.device)
        n = self.world_size
        works = [_all_gather(full[b.start:b.start + n * b.chunk], local[b.shard_off:b.shard_off + b.chunk],
                             group=self.process_group, async_op=True) for b in self._buckets]
        for w in works:
            w.wait()
        return full

    def full_state_dict(self) -> dict[str, Any]:
        """Canonical torch layout keyed by parameter FQN (collective: every rank must call it).

        Per-element state (Adam's ``exp_avg``, ``exp_avg_sq``) is all-gathered from the chunks into
        the flat order and cut back into parameter shapes; scalars (``step``) are copied.
        The same layout as ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(...,
        options=StateDictOptions(full_state_dict=True))``, so a run can resume under any strategy.
        """
        groups = [{**_hyperparameters(g), "params": [self._fqns[self._index[id(p)]] for p in g["params"]]}
                  for g in self.param_groups]
        per_elem: list[str] = []
        for view in self._views:
            s = self.inner.state.get(view, {})
            per_elem = per_elem or [k for k, t in s.items() if torch.is_tensor(t) and t.shape == view.shape]
        scalars_by_group = [{k: v for k, v in self.inner.state.get(g["params"][0], {}).items() if k not in per_elem}
                            for g in self.inner.param_groups]
        gathered = {key: self._gather_flat(torch.cat([self.inner.state[v][key].reshape(-1) for v in self._views]))
                    for key in per_elem}
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
        full optimizer state): every rank keeps only its chunks. No communication."""
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
        ranges = {id(v): r for v, r in zip(self._views, self._ranges)}
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            source = full_state[self._fqns[self._index[id(outer["params"][0])]]]
            for view in inner["params"]:
                lo, hi = ranges[id(view)]
                entry = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in source.items() if k not in per_elem}
                entry.update({k: flats[k][lo:hi].clone() for k in per_elem})
                self.inner.state[view] = entry
