"""This rank's pipeline in ``MeshParallelStrategy`` (``composite.py``), the Lightning side: the cut
planned before ``parallelize`` (``pipeline_plan.py`` decides it), applied in its **cut stages** step,
the schedule built on the stage modules afterwards, what the bubble monitor reads about it, and the
pipeline's side of checkpoints. Running the schedule inside Lightning's loop is ``pipeline_loop.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from typing_extensions import override

from lightning_par import ConfigError
from lightning_par.core.optim import per_tensor_where_mixed
from lightning_par.parallel.contract import ParallelPlan, example_input_of
from lightning_par.parallel.mesh import ParallelDims, dp_coordinates
from lightning_par.parallel.pipeline.schedule import Pipeline, build_schedule, stage_indices_for_rank
from lightning_par.parallel.pipeline.stage_ties import StageTie
from lightning_par.strategies.checkpoint.dcp import canonical_fqn
from lightning_par.strategies.pipeline_plan import PipelinePlan, cut_stages, plan_pipeline

log = logging.getLogger(__name__)


class MeshPipelineMixin:
    """The pipeline of ``MeshParallelStrategy`` (see the module docstring): planned, cut, scheduled."""

    _pipeline: Pipeline | None = None
    _stage_ties: list[StageTie] = []  # a weight shared across pipeline ranks (pipeline/stage_ties.py)
    #: the cut this rank applied (``plan_pipeline``): boundaries, how they were chosen, stages per rank
    pipeline_plan: PipelinePlan | None = None

    @property
    def pipeline(self) -> Pipeline | None:
        """This rank's part of the pipeline (None without one): stage modules, schedule, timer."""
        return self._pipeline

    def pipeline_description(self) -> dict[str, Any]:
        """What the bubble monitor needs to label this rank's measurements."""
        dims = self.parallel_dims
        pp_rank = self.device_mesh["pp"].get_local_rank() if dims.pp > 1 else 0
        tp_rank = self.device_mesh["tp"].get_local_rank() if dims.tp > 1 else 0
        dp_rank, _ = dp_coordinates(self.device_mesh, dims)
        pipe = self._pipeline
        return {"schedule": self.schedule, "pp": dims.pp, "n_microbatches": self.n_microbatches_for(dims.pp),
                "virtual_stages": self.virtual_stages, "pp_rank": pp_rank, "replica": dp_rank * dims.tp + tp_rank,
                "stages": [m.stage_index for m in pipe.modules] if pipe else []}

    def plan_pipeline(self, module: nn.Module, model_plan: ParallelPlan) -> PipelinePlan:
        """Where the model's layers are cut and which stages this rank runs (``pipeline_plan.py``), decided
        before ``parallelize``, over ``model_plan.layers``; a stage starts only at its ``stage_starts`` (() = anywhere).
        ``balance=time`` measures on rank 0 and broadcasts: every rank calls this."""
        dims, mesh, trainer = self.parallel_dims, self.device_mesh, self.lightning_module.trainer
        m = self.n_microbatches_for(dims.pp)
        micro = self._batch_per_pipeline(trainer, dims, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        if micro is not None:  # normally checked before processes start (validate_batch); here as a fallback
            try:
                self.validate_batch(micro, dims.world_size)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        self.pipeline_plan = plan_pipeline(
            module, model_plan.layers, starts=model_plan.stage_starts, stage_runner=model_plan.stage_runner,
            schedule=self.schedule, pp=dims.pp,
            pp_rank=mesh["pp"].get_local_rank() if dims.pp > 1 else 0, virtual_stages=self.virtual_stages,
            split_points=self.split_points, balance=self.balance,
            example=lambda: example_input_of(module)(max(1, (micro or m) // m), device=self.root_device),
            device=self.root_device, measures=self.global_rank == 0, share=self.broadcast)
        return self.pipeline_plan

    def _cut(self, module: nn.Module, plan: PipelinePlan) -> list[nn.Module]:
        """The **cut stages** step of ``parallelize``: applies ``plan`` (this rank's stage modules; other
        layers become ``RemoteLayer``s; a weight shared across pipeline ranks gets a copy on each)."""
        stages, ties = cut_stages(module, plan, self.device_mesh)
        if plan.pp > 1:
            self._stage_ties = ties
        log.info("%s: layers cut at %s (%s); pipeline rank %d holds stages %s", type(self).__name__,
                 list(plan.bounds), plan.chosen_by, plan.pp_rank, list(plan.stage_indices))
        return stages

    def _build_schedule(self, stages: list[nn.Module]) -> Pipeline:
        dims, mesh, trainer = self.parallel_dims, self.device_mesh, self.lightning_module.trainer
        m = self.n_microbatches_for(dims.pp)
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        pp_rank = mesh["pp"].get_local_rank() if dims.pp > 1 else 0
        indices = stage_indices_for_rank(self.schedule, pp_rank, dims.pp, self.virtual_stages)
        self._loss_scale = 1.0 / (m * accumulate)
        pipe = build_schedule(stages, schedule=self.schedule, n_microbatches=m, loss_fn=self._scaled_loss,
                              pp_group=mesh["pp"] if dims.pp > 1 else None, virtual_stages=self.virtual_stages,
                              stage_indices=indices, device=self.root_device)
        # the loss is scaled instead: torch's scaling divides every gradient after each call, which
        # would also shrink the gradients accumulated over earlier batches
        pipe.schedule.scale_grads = False  # type: ignore[attr-defined]
        pipe.scale_aux_losses(self._loss_scale)  # MoE routers' losses: no stage returns them
        return pipe

    def _batch_per_pipeline(self, trainer: Any, dims: ParallelDims, accumulate: int) -> int | None:
        gbs = getattr(getattr(trainer, "datamodule", None), "global_batch_size", None)
        if not gbs or gbs % (dims.dp * accumulate):
            return None
        return gbs // (dims.dp * accumulate)

    # ------------------------------------------------------------------- checkpoints
    # The shared format (strategies/checkpoint/dcp.py): model and optimizer state under the full model's
    # parameter names, each rank writing what it holds. A pipeline rank knows only its own parameters,
    # but the optimizer's ``param_groups`` are one object in the checkpoint (DCP keeps one copy), so
    # they are merged over the ranks first -- then any strategy and layout can load them.
    @override
    def checkpoint_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = get_optimizer_state_dict(self.lightning_module, optimizer)
        if self._pipeline is not None and dist.is_initialized() and dist.get_world_size() > 1:
            order = {canonical_fqn(name): (m.stage_index, i) for m in self._pipeline.modules
                     for i, name in enumerate(m.fqns)}
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (state["param_groups"], order))
            state["param_groups"] = _merge_param_groups(gathered)
        return state

    @override
    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        local = {canonical_fqn(name) for name, _ in self.lightning_module.named_parameters()}
        groups = [{**g, "params": [f for f in g["params"] if f in local]} for g in state["param_groups"]]
        set_optimizer_state_dict(self.lightning_module, optimizer, {**state, "param_groups": groups})
        per_tensor_where_mixed(optimizer)  # a checkpoint's param_groups bring their own ``foreach``


def _merge_param_groups(gathered: Sequence[tuple[list[dict[str, Any]], dict[str, tuple[int, int]]]]) -> list[dict]:
    """One ``param_groups`` list naming every rank's parameters (in stage order), from each rank's own."""
    groups, order = [], {}
    for rank_groups, rank_order in gathered:
        order.update(rank_order)
        for i, g in enumerate(rank_groups):
            if i == len(groups):
                groups.append({**g, "params": []})
            groups[i]["params"].extend(f for f in g["params"] if f not in groups[i]["params"])
    for g in groups:
        g["params"].sort(key=lambda f: order.get(f, (1 << 30, 0)))
    return groups
