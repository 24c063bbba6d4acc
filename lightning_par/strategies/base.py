"""What every lightning_par strategy shares, on top of Lightning's own strategy classes.

``ParStrategyMixin`` adds: the multirun-safe launcher (see ``launcher.py``), a ``ParallelDims``
description of the mesh (``mesh_sizes`` for the run summary), data-parallel sampler ranks taken
from the mesh's data-parallel axis, optional per-block activation checkpointing from the model's
plan, and ``model_state_tensors`` -- the tensors this rank holds per category, which the memory
callback counts. Strategies stay thin: they decide the mesh and call layer 1 (``parallel/``).

``ShardedStrategy`` is the base of the strategies that shard model states without DDP's wrapper
(zero2, zero3, zero3_offload, fsdp/hsdp). It derives from Lightning's ``ModelParallelStrategy``,
Lightning's strategy for modules that parallelize themselves: it does not wrap the model, runs on
CPU (gloo) as on GPU, starts the process group, restores checkpoints after setup (into the sharded
model) and provides barrier/broadcast/reduce/all_gather. We replace its mesh (``ParallelDims``,
built in ``setup_environment``), its ``setup`` (layer-1 techniques instead of the module's own
``configure_model``), its launcher (multirun-safe) and its checkpoint format (strategy-neutral,
``checkpoint.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_par.parallel.checkpointing import apply_activation_checkpointing
from lightning_par.parallel.mesh import ParallelDims, dp_coordinates
from lightning_par.strategies.checkpoint import DistributedCheckpointMixin


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` stored on this rank (a DTensor's local shard, else ``t`` itself)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def model_plan(module: nn.Module):
    """The module's declared ``ParallelPlan``, or None for modules that declare none."""
    fn = getattr(module, "parallel_plan", None)
    return fn() if callable(fn) else None


class ParStrategyMixin:
    """Mixed into a Lightning ``Strategy`` subclass (it must come first in the bases)."""

    #: set by run.py: the command that starts ranks 1..N-1 (None: Lightning's script re-run)
    child_command: Sequence[str] | None = None
    child_cwd: str | None = None
    #: True when the strategy keeps model states in host memory (offload)
    offloads: bool = False
    activation_checkpointing: bool = False

    # ----------------------------------------------------------------------------- mesh
    def dims_for(self, world_size: int) -> ParallelDims:
        """The mesh this strategy builds for ``world_size`` processes (pure: no process group needed)."""
        return ParallelDims(dp_replicate=world_size)

    def validate_setup(self, world_size: int, module: nn.Module) -> None:
        """Raise ``ValueError`` (one line) if this strategy cannot run ``module`` on ``world_size`` ranks.

        Called by run.py before any process starts; the default checks the mesh and that
        activation checkpointing has blocks to wrap.
        """
        self.dims_for(world_size).validate(world_size)
        if self.activation_checkpointing:
            plan = model_plan(module)
            if plan is None or not plan.blocks:
                raise ValueError(f"{type(self).__name__}: activation_checkpointing needs a model that declares its"
                                 f" blocks (parallel_plan().blocks); {type(module).__name__} declares none")

    @property
    def parallel_dims(self) -> ParallelDims:
        return self.dims_for(max(1, getattr(self, "world_size", 1)))

    @property
    def mesh_sizes(self) -> dict[str, int]:
        return self.parallel_dims.sizes()

    # ------------------------------------------------------------------------- launcher
    def _make_launcher(self) -> _SubprocessScriptLauncher:
        from lightning_par.strategies.launcher import ChildCommandLauncher

        return ChildCommandLauncher(self.cluster_environment, self.num_processes, self.num_nodes,
                                    child_command=self.child_command, child_cwd=self.child_cwd)

    # -------------------------------------------------------------------- techniques
    def _apply_activation_checkpointing(self, module: nn.Module) -> None:
        if not self.activation_checkpointing:
            return
        plan = model_plan(module)
        if plan is None or not plan.blocks:
            raise ValueError(f"{type(self).__name__}: activation_checkpointing needs a model that declares its"
                             " blocks (parallel_plan().blocks); this model declares none")
        apply_activation_checkpointing(module, blocks=plan.blocks)

    def _replace_optimizer(self, index: int, new: torch.optim.Optimizer) -> None:
        """Swap optimizer ``index`` for ``new`` (same param groups), re-pointing its LR schedulers."""
        old = self.optimizers[index]
        self.optimizers[index] = new
        for config in self.lr_scheduler_configs:
            if getattr(config.scheduler, "optimizer", None) is old:
                config.scheduler.optimizer = new

    # ------------------------------------------------------------------- measurement
    def model_state_tensors(self) -> dict[str, Iterator[torch.Tensor]]:
        """Tensors this rank holds, by category (local shards only)."""
        module = self.lightning_module
        params = [local_tensor(p) for p in module.parameters()]
        grads = [local_tensor(p.grad) for p in module.parameters() if p.grad is not None]
        states: list[torch.Tensor] = []
        for opt in getattr(self, "optimizers", []) or []:
            for state in _optimizer_states(opt):
                states.extend(local_tensor(v) for v in state.values() if isinstance(v, torch.Tensor))
        return {"params": iter(params), "grads": iter(grads), "optimizer_state": iter(states)}

    def describe(self) -> dict[str, Any]:
        return {"mesh": self.mesh_sizes}


def _optimizer_states(opt: Any) -> Iterator[dict]:
    inner = getattr(opt, "optim", None)  # ZeroRedundancyOptimizer keeps the local optimizer in .optim
    source = inner if isinstance(inner, torch.optim.Optimizer) else opt
    yield from source.state.values()


class ShardedStrategy(ParStrategyMixin, DistributedCheckpointMixin, ModelParallelStrategy):
    """Base of the data-parallel strategies that shard model states without a DDP wrapper.

    Subclasses decide the mesh (``dims_for``), shard the module (``parallelize``) and/or replace the
    optimizer (``setup_optimizers``). Setup order: activation checkpointing, precision conversion,
    move to the device, ``parallelize``, optimizers -- so sharding sees the final modules and dtypes.

    Args:
        activation_checkpointing: recompute each declared block's activations in backward.
        process_group_backend: None picks gloo on CPU and NCCL on CUDA.
        timeout: collective timeout (Lightning's default: 30 minutes).
    """

    def __init__(self, activation_checkpointing: bool = False, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self.activation_checkpointing = activation_checkpointing

    def dims_for(self, world_size: int) -> ParallelDims:
        return ParallelDims(dp_shard=world_size)

    def _configure_launcher(self) -> None:
        self._launcher = self._make_launcher()

    def setup_environment(self) -> None:
        self._setup_distributed()  # device, global ranks, process group (Lightning's)
        dims = self.dims_for(self.world_size)
        dims.validate(self.world_size)
        self._device_mesh = dims.build_mesh(self.root_device.type)
        self.lightning_module._device_mesh = self._device_mesh  # LightningModule.device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        rank, size = dp_coordinates(self._device_mesh, self.dims_for(self.world_size))
        return {"num_replicas": size, "rank": rank}

    def parallelize(self, module: nn.Module) -> None:
        """Shard ``module`` in place on ``self.device_mesh`` (default: nothing)."""

    #: False where ``parallelize`` applies activation checkpointing itself (after TP, torchtitan's order)
    _checkpoint_before_parallelize = True

    def setup(self, trainer: Any) -> None:
        self.accelerator.setup(trainer)
        if self._checkpoint_before_parallelize:
            self._apply_activation_checkpointing(self.lightning_module)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.parallelize(self.lightning_module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
