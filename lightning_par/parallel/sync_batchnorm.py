"""BatchNorm with statistics over the global batch, on any device.

torch's ``nn.SyncBatchNorm`` refuses to run on CPU under DDP ("SyncBatchNorm layers only work with
GPU modules"), so on CPU/gloo lightning_par uses its own: each rank computes the per-channel sum,
sum of squares and count of its slice, one differentiable all-reduce (``torch.distributed.nn``)
adds them over the group, and the layer normalizes with the global mean and (biased) variance --
exactly what single-device BatchNorm computes on the whole batch. The all-reduce's backward sums
the statistics' gradients over ranks, so after DDP averages parameter gradients they equal the
single-device gradients. Running statistics use the unbiased global variance, as BatchNorm does.
On CUDA, torch's own ``SyncBatchNorm`` is used.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class GlobalBatchNorm(_BatchNorm):
    """Drop-in for BatchNorm1d/2d/3d whose training statistics span ``process_group``."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"GlobalBatchNorm: expected at least 2-D input, got {x.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or not (dist.is_available() and dist.is_initialized()):
            return super().forward(x)
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
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_((var * count / (count - 1)).detach(), alpha=m)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


def convert_sync_batchnorm(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every BatchNorm with ``GlobalBatchNorm`` (keeping parameters and buffers)."""
    if isinstance(module, _BatchNorm) and not isinstance(module, (GlobalBatchNorm, nn.SyncBatchNorm)):
        new = GlobalBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                              module.track_running_stats, process_group)
        new.load_state_dict(module.state_dict())
        new.train(module.training)
        return new
    for name, child in module.named_children():
        new_child = convert_sync_batchnorm(child, process_group)
        if new_child is not child:
            setattr(module, name, new_child)
    return module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Back to plain BatchNorm{1,2,3}d (by input rank, as used by the model's checkpoint)."""
    if isinstance(module, GlobalBatchNorm):
        new = nn.BatchNorm2d(module.num_features, module.eps, module.momentum, module.affine,
                             module.track_running_stats)
        new.load_state_dict(module.state_dict())
        new.train(module.training)
        return new
    for name, child in module.named_children():
        new_child = revert_sync_batchnorm(child)
        if new_child is not child:
            setattr(module, name, new_child)
    return module
