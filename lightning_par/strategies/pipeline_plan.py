"""The pipeline's cut, decided before ``parallelize``: which layers each stage holds and which stages
each pipeline rank runs (``MeshParallelStrategy``, ``composite.py``).

``plan_pipeline`` returns a ``PipelinePlan``: the stage boundaries over the model's declared layers,
how they were chosen (explicit ``split_points``; ``params``: equal parameter counts; ``time``: equal
measured forward + backward time, measured on one rank -- on a real host copy when the model was built
on the meta device -- and shared with the others), the per-layer costs balanced, and the stages of
every pipeline rank. The strategy calls it while it lists the techniques, before ``parallelize``; the
**cut stages** step of ``parallelize`` then only applies it (``cut_stages``): this rank's stage
modules, the weights shared across pipeline ranks (``parallel/pipeline/stage_ties.py``), the other ranks'
layers replaced by ``RemoteLayer``s.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_par.parallel.contract import StageRunnerFactory
from lightning_par.parallel.init.materialize import has_meta_tensors
from lightning_par.parallel.pipeline.schedule import (
    balance_layers,
    build_stage_modules,
    layer_costs_by_params,
    stage_indices_for_rank,
)
from lightning_par.parallel.pipeline.stage_ties import StageTie, plan_stage_ties
from lightning_par.parallel.pipeline.stages import (
    check_stage_starts,
    drop_remote_layers,
    measure_layer_times,
    resolve_split_points,
)
from lightning_par.parallel.init.ties import tied_parameters

#: how a cut was chosen: the strategy's ``split_points``, or its ``balance`` (``params`` / ``time``)
CHOSEN_BY = ("split_points", "params", "time")


@dataclass(frozen=True)
class PipelinePlan:
    """Where the model's layers are cut into stages, and which stages each pipeline rank runs."""

    #: the model's layers in order (``ParallelPlan.layers``)
    layers: tuple[str, ...]
    #: stage boundaries ``(0, b_1, ..., len(layers))``: stage s holds ``layers[bounds[s]:bounds[s + 1]]``
    bounds: tuple[int, ...]
    #: ``split_points``, ``params`` or ``time`` (``CHOSEN_BY``)
    chosen_by: str
    #: the cost of every layer that was balanced (parameters or seconds); None for split points
    costs: tuple[float, ...] | None
    #: pipeline ranks (``pp``), and this rank's position on that axis
    pp: int
    pp_rank: int
    #: ``stage_ranks[s]``: the pipeline rank that runs stage s (the schedule's loop or V layout)
    stage_ranks: tuple[int, ...]
    #: the stages this rank runs, in the schedule's order (``stage_indices_for_rank``)
    stage_indices: tuple[int, ...]
    #: how a stage runs the model's own forward (``ParallelPlan.stage_runner``; None: layer after layer)
    stage_runner: StageRunnerFactory | None = field(default=None, compare=False, repr=False)

    @property
    def n_stages(self) -> int:
        return len(self.bounds) - 1

    def owner(self) -> dict[str, int]:
        """Layer path -> the stage that holds it."""
        return {path: s for s in range(self.n_stages) for path in self.layers[self.bounds[s]:self.bounds[s + 1]]}


def plan_pipeline(module: nn.Module, layers: Sequence[str], *, starts: Sequence[int] = (),
                  stage_runner: StageRunnerFactory | None = None, schedule: str, pp: int,
                  pp_rank: int, virtual_stages: int, split_points: Sequence[int | str] | None = None,
                  balance: str = "params", example: Callable[[], torch.Tensor] | None = None,
                  device: torch.device | str = "cpu", measures: bool = True,
                  share: Callable[[Any], Any] = lambda costs: costs) -> PipelinePlan:
    """The cut of ``layers`` into ``pp * virtual_stages`` stages (a stage starts only at ``starts``,
    ``ParallelPlan.stage_starts``; () = anywhere). One-line ``ValueError`` for an impossible cut.

    ``balance="time"`` (without ``split_points``) runs the model's layers on ``example()``: only where
    ``measures`` (one rank), on ``measurable(module, device)``; ``share`` hands that rank's costs to
    every rank (the strategy's ``broadcast``; every rank must call this then)."""
    layers = list(layers)
    n_stages = pp * virtual_stages
    costs: list[float] | None
    if split_points is not None:
        chosen_by, costs = "split_points", None
        bounds = resolve_split_points(layers, split_points, n_stages, starts)
    elif balance == "time":
        chosen_by, costs = "time", None
        if measures:
            if example is None:
                raise ValueError("balance=time needs an example input to measure the layers on")
            costs = measure_layer_times(measurable(module, device), layers, example(), starts=starts,
                                        stage_runner=stage_runner)
        costs = share(costs)
        bounds = balance_layers(costs, n_stages, starts)
    else:
        chosen_by, costs = "params", layer_costs_by_params(module, layers)
        bounds = balance_layers(costs, n_stages, starts)
    check_stage_starts(layers, bounds, starts)
    rank_of_stage = {s: r for r in range(pp) for s in stage_indices_for_rank(schedule, r, pp, virtual_stages)}
    return PipelinePlan(layers=tuple(layers), bounds=tuple(bounds), chosen_by=chosen_by,
                        costs=tuple(float(c) for c in costs) if costs is not None else None, pp=pp, pp_rank=pp_rank,
                        stage_ranks=tuple(rank_of_stage[s] for s in range(n_stages)),
                        stage_indices=tuple(stage_indices_for_rank(schedule, pp_rank, pp, virtual_stages)),
                        stage_runner=stage_runner)


def cut_stages(module: nn.Module, plan: PipelinePlan, mesh: Any) -> tuple[list[nn.Module], list[StageTie]]:
    """Apply ``plan`` to ``module`` (the **cut stages** step of ``parallelize``): this rank's stage
    modules, sharing the model's submodules; the other ranks' layers become ``RemoteLayer``s. With
    pp > 1, a weight shared by layers on two pipeline ranks gets a copy on each, kept equal (the
    returned ``StageTie``s; every rank must call this: it creates process groups)."""
    layers, owner = list(plan.layers), plan.owner()
    ties: list[StageTie] = []
    if plan.pp > 1:
        ties = plan_stage_ties(tied_parameters(module), layers, lambda p: plan.stage_ranks[owner[p]], mesh)
    stages = build_stage_modules(module, layers=layers, boundaries=list(plan.bounds),
                                 stage_indices=list(plan.stage_indices), stage_runner=plan.stage_runner)
    drop_remote_layers(module, layers, {path for stage in stages for path in stage.layers}, owner)
    return stages, ties


def measurable(module: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """What ``balance=time`` measures: ``module`` itself (moved to ``device`` when it holds no meta tensor
    at all, as ``parallelize``'s first step moves it); or, when it was built on the meta device, a real host copy (measuring layer
    times needs real tensors; its values do not matter for timing)."""
    if not any(p.is_meta for p in module.parameters()):
        return module if has_meta_tensors(module) else module.to(device)
    real = copy.deepcopy(module).to_empty(device="cpu")
    for sub in real.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
    return real
