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
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model spread over ranks; returns the total norm.

    The norm is that of the *whole* model's gradient: DTensor gradients (TP shards, FSDP shards) give
    their full norm over their own mesh; the ranks of a pipeline hold different stages, so their
    norms are combined over ``pp_group`` (sum of p-th powers, or max for the inf-norm).
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if grads:
        total = torch.nn.utils.get_total_norm(grads, norm_type)
        if isinstance(total, DTensor):
            total = total.full_tensor()
    else:
        total = torch.zeros(())
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total.double() ** norm_type
            dist.all_reduce(total, group=pp_group)
            total = (total ** (1.0 / norm_type)).float()
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
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


