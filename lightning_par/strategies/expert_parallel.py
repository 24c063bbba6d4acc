"""``expert_parallel``: the routed experts of an MoE model spread over an ``ep`` mesh axis, the rest
of the model data parallel; composable with FSDP (``data_parallel=fsdp``, torchtitan-style).

Mesh: ``ep`` ranks form an expert-parallel group (each holds n_experts/ep experts of every MoE
layer and exchanges tokens with the others by all-to-all, ``parallel/tensor/expert_parallel.py``); the
world is ``dp x ep`` with ``dp = world / ep`` on ``dp_replicate`` (``data_parallel=replicate``) or
``dp_shard`` (``fsdp``). Every rank reads its own batch: ep is a data axis too, so the
data-parallel degree is the whole world.

Gradients. Non-expert parameters are replicated (or FSDP-sharded) over the whole world and
averaged over it. An expert's weights already received, through the all-to-all's backward, the
gradient of every rank of its ep group; their copies over the dp axis are summed and the total
divided by the world size: 1/ep in backward (``Experts.grad_scale``, before accumulation), then
the mean over the dp axis (FSDP's reduce-scatter, or an all-reduce over ``dp_replicate``).

With ``ep`` = the world and ``fsdp``, the experts are split over ep only (outside FSDP) and the rest
is FSDP-sharded over the world.

This is ``MeshParallelStrategy`` (``strategies/composite.py``) with tp = pp = 1 and ep taken from the
data axis -- the mesh, the techniques, the gradient averaging and clipping are its own. Tensor and
pipeline parallelism: the other mesh strategies take the same ``ep`` option.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from typing_extensions import override

from lightning_par.parallel.tensor.expert_parallel import check_expert_parallel
from lightning_par.parallel.mesh import ParallelDims
from lightning_par.strategies.composite import MeshParallelStrategy


class ExpertParallelStrategy(MeshParallelStrategy):
    """Expert parallelism x data parallelism (see the module docstring).

    Args:
        ep: expert-parallel ranks (must divide the world and the number of experts); None: the world.
        data_parallel: ``replicate`` (parameters replicated over the dp axis, gradients averaged) or
            ``fsdp`` (FSDP2: non-expert parameters sharded over the whole world, experts over dp,
            if dp > 1).
        reshard_after_forward: FSDP: free gathered parameters after forward.
        activation_checkpointing: true or "full" recomputes each block in backward, "selective" keeps matmuls,
            k (an int) recomputes every k-th block.
    """

    strategy_name = "lp_expert_parallel"

    def __init__(self, ep: int | None = None, data_parallel: str = "replicate", reshard_after_forward: bool = True,
                 activation_checkpointing: bool | str = False, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        if ep is not None and (not isinstance(ep, int) or isinstance(ep, bool) or ep < 1):
            raise ValueError(f"{type(self).__name__}: ep must be a positive integer or null (= the world size), "
                             f"got {ep!r}")
        super().__init__(pp=1, tp=1, data_parallel=data_parallel, reshard_after_forward=reshard_after_forward,
                         activation_checkpointing=activation_checkpointing, ep=ep or 1,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.ep = ep  # None: the world, whatever its size

    @override
    def dims_for(self, world_size: int) -> ParallelDims:
        ep = self.ep or world_size
        if world_size % ep:
            raise ValueError(f"{type(self).__name__}: ep={ep} does not divide the world size {world_size}; "
                             f"use a multiple of {ep} for trainer.devices x trainer.num_nodes")
        return self.mesh_dims(world_size, ep)

    @override
    def check_experts(self, dims: ParallelDims, plan: Any, model: str) -> None:
        """Whatever ep is: the model declares experts, and ep divides their number."""
        if not getattr(plan, "experts", ()):
            raise ValueError(f"{type(self).__name__}: {model} has no experts to spread over ranks (its "
                             "parallel_plan() declares no `experts`); use an MoE model (model=moe_tiny) or another "
                             "strategy")
        check_expert_parallel(dims.ep, getattr(plan, "n_experts", 0), model)
