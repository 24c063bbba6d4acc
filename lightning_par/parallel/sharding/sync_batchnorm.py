"""BatchNorm with statistics over the global batch, on any device.

torch's ``nn.SyncBatchNorm`` refuses to run on CPU under DDP ("SyncBatchNorm layers only work with
GPU modules"), so on CPU/gloo lightning_par uses its own: each rank computes the per-channel sum,
sum of squares and count of its slice, one differentiable all-reduce (``torch.distributed.nn``)
adds them over the group, and the layer normalizes with the global mean and (biased) variance --
exactly what single-device BatchNorm computes on the whole batch. The all-reduce's backward sums
the statistics' gradients over ranks, so after DDP averages parameter gradients they equal the
single-device gradients. Running statistics use the unbiased global variance, as BatchNorm does.
Under DDP on CUDA, torch's own ``SyncBatchNorm`` is used; everywhere else (CPU, and the sharded and
mesh strategies, whose BatchNorm is converted on the meta model and deep-copied for deferred
initialisation, which a ``ProcessGroup`` held by torch's layer does not survive) this one.

``process_group`` must be the data-parallel ranks' group (the ranks that read different samples),
not the tensor- or pipeline-parallel ranks'.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch.distributed.tensor import DTensor
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class GlobalBatchNorm(_BatchNorm):
    """Drop-in for BatchNorm1d/2d/3d whose training statistics span ``process_group``."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group
        #: the class this layer replaced, restored by ``revert_sync_batchnorm`` (BatchNorm1d stays 1d)
        self.original_cls: type[_BatchNorm] = nn.BatchNorm2d

    def __deepcopy__(self, memo: dict[int, Any]) -> GlobalBatchNorm:
        # a ProcessGroup cannot be copied (deferred initialisation deep-copies init groups,
        # parallel/init/materialize.py): the copy shares the group, everything else is copied
        if self.process_group is not None:
            memo.setdefault(id(self.process_group), self.process_group)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"GlobalBatchNorm: expected at least 2-D input, got {x.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or not (dist.is_available() and dist.is_initialized()):
            return super().forward(x)
        if isinstance(x, DTensor):
            # beside tensor parallelism the activations (and this layer's tensors) are DTensors replicated
            # over the tp ranks: every tp rank holds the whole local batch, and the statistics span the
            # data-parallel group only. Activations sharded over tp would need the tp ranks too.
            if not all(p.is_replicate() for p in x.placements):
                raise ValueError(f"GlobalBatchNorm: input sharded over the mesh ({x.placements}); "
                                 "synchronized BatchNorm needs it replicated over the tensor-parallel ranks")
            y = self._normalize(x.to_local())
            return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False)
        return self._normalize(x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        dims = [0, *range(2, x.dim())]  # every dimension but channels
        local = torch.cat([x.sum(dims), (x * x).sum(dims),
                           x.new_full((1,), x.numel() / x.shape[1])])  # (2C + 1,)
        total = dist_fn.all_reduce(local, group=self.process_group or dist.group.WORLD)
        c = self.num_features
        count = total[-1]
        mean = total[:c] / count
        var = total[c : 2 * c] / count - mean * mean  # biased, as BatchNorm normalizes with
        if self.training and self.track_running_stats:
            with torch.no_grad():
                _local(self.num_batches_tracked).add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(_local(self.num_batches_tracked))
                _local(self.running_mean).mul_(1 - m).add_(mean.detach(), alpha=m)
                _local(self.running_var).mul_(1 - m).add_((var * count / (count - 1)).detach(), alpha=m)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * _local(self.weight).view(shape) + _local(self.bias).view(shape)
        return y


def _local(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's local tensor (differentiable, same storage), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _take_tensors(new: nn.Module, old: nn.Module) -> None:
    """``new`` holds ``old``'s very parameter and buffer objects (as torch's ``convert_sync_batchnorm``
    does), so this works on a meta model and keeps what refers to them (init records, optimizers)."""
    new._parameters = dict(old._parameters)
    new._buffers = dict(old._buffers)
    new._non_persistent_buffers_set = set(old._non_persistent_buffers_set)
    new.train(old.training)
    if hasattr(old, "qconfig"):
        new.qconfig = old.qconfig


def convert_sync_batchnorm(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every BatchNorm with ``GlobalBatchNorm`` over ``process_group`` (None: the default
    group), keeping its parameter and buffer objects; works on a meta model too."""
    if isinstance(module, _BatchNorm) and not isinstance(module, (GlobalBatchNorm, nn.SyncBatchNorm)):
        with torch.device("meta"):  # its own tensors are replaced by the layer's at once
            new = GlobalBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, process_group)
        _take_tensors(new, module)
        new.original_cls = type(module)
        return new
    for name, child in module.named_children():
        new_child = convert_sync_batchnorm(child, process_group)
        if new_child is not child:
            setattr(module, name, new_child)
    return module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Back to the BatchNorm class each ``GlobalBatchNorm`` replaced (same parameter and buffer objects)."""
    if isinstance(module, GlobalBatchNorm):
        with torch.device("meta"):
            try:
                new = module.original_cls(module.num_features, module.eps, module.momentum, module.affine,
                                          module.track_running_stats)
            except TypeError:  # a BatchNorm subclass with its own constructor
                new = nn.BatchNorm2d(module.num_features, module.eps, module.momentum, module.affine,
                                     module.track_running_stats)
        _take_tensors(new, module)
        return new
    for name, child in module.named_children():
        new_child = revert_sync_batchnorm(child)
        if new_child is not child:
            setattr(module, name, new_child)
    return module
