"""``expert_parallel``: the routed experts of an MoE model spread over an ``ep`` mesh axis, the rest
of the model data parallel; composable with FSDP (``data_parallel=fsdp``, torchtitan-style).

Mesh: ``ep`` ranks form an expert-parallel group (each holds n_experts/ep experts of every MoE
layer and exchanges tokens with the others by all-to-all, ``parallel/expert_parallel.py``); the
world is ``dp x ep`` with ``dp = world / ep`` on ``dp_replicate`` (``data_parallel=replicate``) or
``dp_shard`` (``fsdp``). Every rank reads its own batch: ep is a data axis too, so the
data-parallel degree is the whole world.

Gradients. Non-expert parameters are replicated (or FSDP-sharded) over the whole world and
averaged over it. An expert's weights already received, through the all-to-all's backward, the
gradient of every rank of its ep group; their copies over the dp axis are summed and the total
divided by the world size: 1/ep in backward (``Experts.grad_scale``, before accumulation), then
the mean over the dp axis (FSDP's reduce-scatter, or an all-reduce over ``dp_replicate``).

With ``ep`` = the world and ``fsdp``, the experts are split over ep only (outside FSDP) and the rest
is FSDP-sharded over the world. Tensor and pipeline parallelism: the mesh strategies take the same
``ep`` option (``strategies/composite.py``), through the same ``parallelize`` steps.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn
from typing_extensions import override

from lightning_par.parallel.discovery import ResolvedPlan, resolve_plan
from lightning_par.parallel.expert_parallel import average_replicated_gradients, check_expert_parallel, data_mesh
from lightning_par.optim import per_tensor_where_mixed
from lightning_par.parallel.gradients import clip_grad_norm_
from lightning_par.parallel.mesh import ParallelDims
from lightning_par.parallel.parallelize import ExpertParallel, FullyShard
from lightning_par.strategies.base import ShardedStrategy

DATA_PARALLEL = ("replicate", "fsdp")


class ExpertParallelStrategy(ShardedStrategy):
    """Expert parallelism x data parallelism (see the module docstring).

    Args:
        ep: expert-parallel ranks (must divide the world and the number of experts); None: the world.
        data_parallel: ``replicate`` (parameters replicated over the dp axis, gradients averaged) or
            ``fsdp`` (FSDP2: non-expert parameters sharded over the whole world, experts over dp,
            if dp > 1).
        reshard_after_forward: FSDP: free gathered parameters after forward.
        activation_checkpointing: recompute each block's activations in backward.
    """

    strategy_name = "lp_expert_parallel"

    def __init__(self, ep: int | None = None, data_parallel: str = "replicate", reshard_after_forward: bool = True,
                 activation_checkpointing: bool = False, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        super().__init__(activation_checkpointing=activation_checkpointing,
                         process_group_backend=process_group_backend, timeout=timeout)
        name = type(self).__name__
        if ep is not None and (not isinstance(ep, int) or isinstance(ep, bool) or ep < 1):
            raise ValueError(f"{name}: ep must be a positive integer or null (= the world size), got {ep!r}")
        if data_parallel not in DATA_PARALLEL:
            raise ValueError(f"{name}: data_parallel must be one of {', '.join(DATA_PARALLEL)}, got {data_parallel!r}")
        self.ep, self.data_parallel, self.reshard_after_forward = ep, data_parallel, reshard_after_forward
        self._data_mesh: Any = None

    # ----------------------------------------------------------------------------- mesh
    @override
    def dims_for(self, world_size: int) -> ParallelDims:
        ep = self.ep or world_size
        if world_size % ep:
            raise ValueError(f"{type(self).__name__}: ep={ep} does not divide the world size {world_size}; "
                             f"use a multiple of {ep} for trainer.devices x trainer.num_nodes")
        dp = world_size // ep
        if self.data_parallel == "fsdp":
            return ParallelDims(dp_shard=dp, ep=ep)
        return ParallelDims(dp_replicate=dp, ep=ep)

    @override
    def validate_setup(self, world_size: int, module: nn.Module) -> None:
        super().validate_setup(world_size, module)
        name, model = type(self).__name__, type(module).__name__
        plan = resolve_plan(module).plan
        experts = getattr(plan, "experts", ())
        if not experts:
            raise ValueError(f"{name}: {model} has no experts to spread over ranks (its parallel_plan() declares "
                             "no `experts`); use an MoE model (model=moe_tiny) or another strategy")
        dims = self.dims_for(world_size)
        check_expert_parallel(dims.ep, getattr(plan, "n_experts", 0), model)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # one 1-D mesh over every data rank: FSDP of the non-expert parameters shards over all of them
        self._data_mesh = data_mesh(self.device_mesh) or self.device_mesh

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            clip_grad_norm_(plugin.main_params(optimizer), clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    # ---------------------------------------------------------------- applying techniques
    @override
    def techniques(self, module: nn.Module, resolved: ResolvedPlan) -> dict[str, Any]:
        dims, mesh = self.parallel_dims, self.device_mesh
        experts = tuple(getattr(resolved.plan, "experts", ()))
        fsdp = self.data_parallel == "fsdp" and dims.world_size > 1
        out: dict[str, Any] = {}
        if dims.ep > 1:
            out["expert_parallel"] = ExpertParallel(mesh["ep"], experts=experts,
                                                    fsdp_mesh=mesh["dp_shard"] if fsdp and dims.dp_shard > 1 else None)
        if fsdp:
            out["fully_shard"] = FullyShard(self._data_mesh, reshard_after_forward=self.reshard_after_forward)
        return out

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        for opt in self.optimizers:
            per_tensor_where_mixed(opt)

    @override
    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        super().load_optimizer_state(optimizer, state)
        per_tensor_where_mixed(optimizer)  # a checkpoint's param_groups bring their own ``foreach``

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        dims = self.parallel_dims
        if self.data_parallel == "replicate" and dims.world_size > 1:
            average_replicated_gradients(self.lightning_module, self.device_mesh, self._data_mesh)
        return closure_loss

    @override
    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "data_parallel": self.data_parallel}
