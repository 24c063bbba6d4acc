"""Gradient operations for a model spread over ranks in several ways at once (plain torch)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, *, norm_type: float = 2.0,
                    pp_group: dist.ProcessGroup | None = None, norm_excluded: set[int] = frozenset()) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model spread over ranks; returns the total norm.

    The norm is that of the *whole* model's gradient: DTensor gradients (TP shards, FSDP shards) give
    their full norm over their own mesh; the ranks of a pipeline hold different stages, so their
    norms are combined over ``pp_group`` (sum of p-th powers, or max for the inf-norm).
    ``norm_excluded``: ids of parameters clipped but not counted (a second pipeline stage's copy of a
    shared weight, ``pipeline/stage_ties.py``).
    """
    params = [p for p in parameters if p.grad is not None]
    # torch's foreach norm refuses a list mixing plain tensors and DTensors on different meshes (expert
    # parallelism's experts on ep, FSDP shards on the data mesh, TP shards on tp): each kind is normed
    # on its own (a DTensor's norm over its whole mesh) and the norms combined
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(p)
    norms = []
    for group in groups.values():
        group = [p for p in group if id(p) not in norm_excluded]
        if not group:
            continue
        n = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)
        norms.append((n.full_tensor() if isinstance(n, DTensor) else n).float())
    if not norms:
        total = torch.zeros(())
    elif len(norms) == 1:
        total = norms[0]
    else:
        stacked = torch.stack(norms)
        total = stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum().pow(1.0 / norm_type)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total.double() ** norm_type
            dist.all_reduce(total, group=pp_group)
            total = (total ** (1.0 / norm_type)).float()
    for group in groups.values():  # clip_grads_with_norm_'s foreach path wants one kind per call too
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def average_gradients(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average the gradients (local shards of DTensor gradients) over ``group``: one all-reduce per
    dtype of all of them flattened together (plain data parallelism, no overlap with backward)."""
    size = dist.get_world_size(group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            g = _local(p.grad)
            by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


