"""``fsdp`` (and the ``hsdp`` preset): fully sharded data parallel with FSDP2's ``fully_shard``.

Every parameter, gradient and optimizer state is a 1/N shard (a ``DTensor``); each *unit* gathers
its full parameters just before its forward (and again before its backward) and frees them after;
gradients are reduce-scattered back to shards. The options are FSDP's knobs: which modules are
units, whether to free parameters after forward (ZeRO-3) or keep them until backward, how far
ahead to prefetch, mixed precision of the gathered parameters and of the gradient reduction, CPU
offload, and HSDP: ``replicate`` > 1 builds a 2-D mesh (dp_replicate, dp_shard), sharding inside
each group of ``world / replicate`` ranks and all-reducing gradients across the groups.

``zero3`` and ``zero3_offload`` (``strategies/zero.py``) are this strategy with fixed settings.
The sharding itself is layer 1 (``parallel/sharding/fsdp.py``); the options are one ``FSDPOptions``
(``fsdp_options.py``, shared with every strategy that shards with FSDP); this file decides the mesh
and does the Lightning plumbing (inherited from ``ShardedStrategy``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_par.parallel.discovery import ResolvedPlan
from lightning_par.parallel.sharding.fsdp import resolve_units
from lightning_par.parallel.layout import CostOptions
from lightning_par.parallel.mesh import ParallelDims
from lightning_par.strategies.base import ShardedStrategy
from lightning_par.strategies.fsdp_options import FSDPOptions, FSDPOptionsMixin


#: when FSDP reduces gradients under accumulation (``FSDPStrategy(grad_sync=...)``)
GRAD_SYNC = ("every_micro_batch", "last_micro_batch")


class FSDPStrategy(FSDPOptionsMixin, ShardedStrategy):
    """Fully sharded data parallel (FSDP2), optionally hybrid (HSDP).

    Args:
        units: the modules sharded as units -- ``"blocks"`` (the model's blocks: declared, a Hugging
            Face model's ``_no_split_modules``, its repeated children, or size-based; see
            ``parallel/discovery.py``), a
            class name (every submodule of that class), an int (minimum parameters per unit, size
            based), or a list of module paths. The root module always takes what no unit claimed.
        reshard_after_forward: free gathered parameters after forward (ZeRO-3); False keeps them
            until backward (less communication, more memory).
        prefetch: units whose all-gather each unit issues ahead, in forward and backward.
        param_dtype / reduce_dtype: FSDP mixed precision (``bf16``, ``fp16``, ``fp32`` or null):
            dtype of the gathered parameters used for compute, and of the gradient reduction.
            Shards, gradients and optimizer state stay fp32.
        cpu_offload: keep parameter shards, gradients and optimizer state in host memory; the
            optimizer step runs on the host.
        replicate: HSDP replica groups (1: plain FSDP); must divide the world size.
        activation_checkpointing: true or "full" recomputes each block in backward, "selective" keeps matmuls,
            k (an int) recomputes every k-th block.
        process_group_backend: None picks gloo on CPU and NCCL on CUDA.
        timeout: collective timeout (Lightning's default: 30 minutes).
        sync_batchnorm: BatchNorm statistics over all ranks (as ``Trainer(sync_batchnorm=True)``), the
            layers converted on the meta model, before sharding.
        grad_sync: with gradient accumulation, ``every_micro_batch`` reduce-scatters each micro-batch's
            gradients (ZeRO-3: gradients stay sharded); ``last_micro_batch`` skips the reduction on all
            but the last (FSDP2's ``set_requires_gradient_sync``): one reduce-scatter (and, HSDP, one
            all-reduce) per optimizer step instead of one per micro-batch, at the cost of holding
            unsharded gradients between micro-batches.
    """

    strategy_name = "lp_fsdp"

    def __init__(self, units: int | str | Sequence[str] = "blocks", reshard_after_forward: bool = True,
                 prefetch: int = 1, param_dtype: str | None = None, reduce_dtype: str | None = None,
                 cpu_offload: bool = False, replicate: int = 1, activation_checkpointing: bool | str = False,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 sync_batchnorm: bool = False, grad_sync: str = "every_micro_batch") -> None:
        super().__init__(activation_checkpointing=activation_checkpointing,
                         process_group_backend=process_group_backend, timeout=timeout, sync_batchnorm=sync_batchnorm)
        self.fsdp_options = FSDPOptions(units=units, reshard_after_forward=reshard_after_forward, prefetch=prefetch,
                                        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cpu_offload=cpu_offload)
        self.replicate = replicate
        self.grad_sync = grad_sync

    # ----------------------------------------------------------------------------- mesh
    def cost_options(self) -> CostOptions:
        return replace(super().cost_options(), grad_sync=self.grad_sync)

    def dims_for(self, world_size: int) -> ParallelDims:
        r = self.replicate
        if not isinstance(r, int) or r < 1 or world_size % r:
            raise ValueError(f"{type(self).__name__}: replicate={r} must be a positive divisor of the world size "
                             f"{world_size} (HSDP: world = replicate x shard)")
        return ParallelDims(dp_replicate=r, dp_shard=world_size // r) if r > 1 else ParallelDims(dp_shard=world_size)

    def weight_splits(self, world_size: int) -> list[str]:
        return ["fully_shard"]

    def validate_setup(self, world_size: int, module: nn.Module) -> None:
        super().validate_setup(world_size, module)
        self.fsdp_options.check(type(self).__name__)
        if self.grad_sync not in GRAD_SYNC:
            raise ValueError(f"{type(self).__name__}: grad_sync={self.grad_sync!r}; choose one of {', '.join(GRAD_SYNC)}")
        self.unit_paths(module)

    def unit_paths(self, module: nn.Module) -> list[str] | None:
        """Module paths of the FSDP units for ``module`` (None: the model's blocks, resolved by
        ``parallel/discovery.py``); raises ValueError naming the model's block classes."""
        if self.units == "blocks":
            return None
        return resolve_units(module, self.units)

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning enters this around the backward of every micro-batch but the last: with
        ``grad_sync=last_micro_batch`` FSDP keeps those gradients unsharded and unreduced."""
        module = self.lightning_module
        if self.grad_sync != "last_micro_batch" or not isinstance(module, FSDPModule):
            yield
            return
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    # ------------------------------------------------------------------------ sharding
    def techniques(self, module: nn.Module, resolved: ResolvedPlan) -> dict:
        return {"fully_shard": self.fsdp_options.technique(self.device_mesh)}
