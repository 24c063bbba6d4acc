"""Sizing and validation for ``MeshParallelStrategy`` (``composite.py``): pure functions, no process group.

**Sizing**: ``axis_sizes`` infers the one free axis (``pp`` or ``tp`` = None: the rest of the world) or
the data-parallel degree ``dp = world / (pp * tp)``; ``mesh_dims`` takes ``ep`` ranks from the data axis
and puts the rest on ``dp_shard`` (``data_parallel="fsdp"``) or ``dp_replicate``.

**Validation**: one small function per technique, each raising a one-line ``ValueError`` that names
the strategy (``name``). ``MeshParallelStrategy.validate_setup`` calls them in this order (the order in
which a layout with several mistakes reports the first one): ``check_fsdp``, ``check_pipeline`` (only
when a pipeline runs), ``check_tensor_parallel``, ``check_sequence_parallel``, ``check_loss_parallel``,
``check_expert_parallel`` (through the strategy's ``check_experts`` hook, which
``ExpertParallelStrategy`` replaces), ``check_moe_sequence_parallel``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_par.parallel.contract import example_input_of, loss_fn_of
from lightning_par.parallel.tensor.expert_parallel import check_expert_parallel as check_expert_sizes
from lightning_par.parallel.hf.stages import check_hf_pipeline
from lightning_par.parallel.mesh import ParallelDims
from lightning_par.parallel.pipeline.schedule import SCHEDULES, validate_pipeline
from lightning_par.parallel.pipeline.stages import n_stage_starts, resolve_split_points
from lightning_par.parallel.tensor.tensor_parallel import check_sequence_parallel as check_sp_plan
from lightning_par.parallel.tensor.tensor_parallel import check_tp_divisible

DATA_PARALLEL = ("replicate", "fsdp")
BALANCE = ("params", "time")


# ------------------------------------------------------------------------------------ options
def check_options(name: str, *, pp: Any, tp: Any, data_parallel: Any, ep: Any, schedule: Any,
                  balance: Any) -> None:
    """The constructor's arguments, each on its own (``MeshParallelStrategy.__init__``)."""
    if pp is None and tp is None:
        raise ValueError(f"{name}: at most one of pp and tp may be null (= the rest of the world)")
    for key, value in (("pp", pp), ("tp", tp)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}: {key} must be a positive integer or null, got {value!r}")
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"{name}: data_parallel must be one of {', '.join(DATA_PARALLEL)}, got {data_parallel!r}")
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"{name}: ep must be a positive integer, got {ep!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"{name}: unknown pipeline schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if balance not in BALANCE:
        raise ValueError(f"{name}: balance must be one of {', '.join(BALANCE)}, got {balance!r}")


# -------------------------------------------------------------------------------------- sizes
def axis_sizes(name: str, pp: int | None, tp: int | None, world_size: int) -> tuple[int, int, int]:
    """(pp, tp, dp) for ``world_size`` ranks; one-line ValueError when they do not fit."""
    if pp is None or tp is None:
        known = tp if pp is None else pp
        assert known is not None  # check_options: at most one of them is None
        if world_size % known:
            axis = "tp" if pp is None else "pp"
            raise ValueError(f"{name}: {axis}={known} does not divide the world size {world_size}; "
                             f"use a multiple of {known} for trainer.devices x trainer.num_nodes")
        rest = world_size // known
        return (rest, known, 1) if pp is None else (known, rest, 1)
    if world_size % (pp * tp):
        on = [f"{k}={v}" for k, v in (("pp", pp), ("tp", tp)) if v > 1]
        sizes = " x ".join(on) + (f" = {pp * tp}" if len(on) > 1 else "")
        raise ValueError(f"{name}: {sizes} does not divide the world size {world_size}; choose sizes whose "
                         "product divides trainer.devices x trainer.num_nodes")
    return pp, tp, world_size // (pp * tp)


def mesh_dims(name: str, *, pp: int | None, tp: int | None, ep: int, data_parallel: str,
              world_size: int) -> ParallelDims:
    """The mesh for ``world_size`` ranks with ``ep`` expert-parallel ranks taken from the data axis."""
    pp, tp, dp = axis_sizes(name, pp, tp, world_size)
    if dp % ep:
        raise ValueError(f"{name}: ep={ep} does not divide the data-parallel degree {dp} "
                         f"(world {world_size} / (pp={pp} x tp={tp})); expert parallelism takes its ranks "
                         "from the data axis")
    dp //= ep
    if data_parallel == "fsdp":
        return ParallelDims(pp=pp, dp_shard=dp, ep=ep, tp=tp)
    return ParallelDims(pp=pp, dp_replicate=dp, ep=ep, tp=tp)


# ---------------------------------------------------------------------------- one per technique
def check_fsdp(name: str, dims: ParallelDims, *, param_dtype: str | None, reduce_dtype: str | None) -> None:
    """FSDP's mixed precision (param_dtype / reduce_dtype) needs an FSDP axis (dp_shard > 1)."""
    if (param_dtype or reduce_dtype) and dims.dp_shard <= 1 and dims.ep > 1:
        raise ValueError(f"{name}: param_dtype/reduce_dtype need a dp_shard axis beside ep={dims.ep} (with none, "
                         "the experts stay outside FSDP, uncast); use trainer.precision=bf16-mixed instead")
    if (param_dtype or reduce_dtype) and dims.dp_shard <= 1:
        raise ValueError(f"{name}: param_dtype/reduce_dtype are FSDP mixed precision, but this layout has no "
                         f"FSDP axis (dp_shard={dims.dp_shard}); use trainer.precision=bf16-mixed instead")


def check_pipeline(name: str, module: nn.Module, plan: Any, dims: ParallelDims, world_size: int, *, schedule: str,
                   n_microbatches: int, virtual_stages: int, split_points: Sequence[int | str] | None,
                   balance: str, loss_parallel: bool, pipelined: bool) -> None:
    """A pipeline (called only when one runs): the model says where it may be cut and has a loss, the
    schedule fits the sizes, its stages can run its own forward, the cut is possible, and the options
    that a pipeline cannot run are off."""
    model = type(module).__name__
    if not plan.layers and plan.pp_refusal:
        raise ValueError(f"{name}: pipeline: {plan.pp_refusal}")
    if not plan.layers:
        raise ValueError(f"{name}: pipeline parallelism needs to know where {model} may be cut; declare "
                         "parallel_plan().layers (paths applied one after another, one tensor to one "
                         "tensor; see README 'Use your own model')")
    if loss_fn_of(module) is None:
        raise ValueError(f"{name}: the pipeline's last stage needs {model}.loss_fn(output, target)")
    n_stages = validate_pipeline(schedule, pp_size=dims.pp, n_microbatches=n_microbatches,
                                 virtual_stages=virtual_stages,
                                 n_layers=n_stage_starts(plan.layers, plan.stage_starts),
                                 of_layers=len(plan.layers))
    # its stages run its own forward: refuse one that cannot
    check_hf_pipeline(module, plan.layers, starts=plan.stage_starts)
    if split_points is not None:
        resolve_split_points(plan.layers, split_points, n_stages, plan.stage_starts)
    elif balance == "time" and example_input_of(module) is None:
        raise ValueError(f"{name}: balance=time measures layers on {model}.example_input(batch_size), "
                         "which it does not define; use balance=params or split_points")
    if loss_parallel:
        raise ValueError(f"{name}: loss_parallel is not supported with pipeline stages; "
                         "set loss_parallel=false")
    if pipelined and dims.pp == 1 and world_size > 1:
        raise ValueError(f"{name}: pp=1 on {world_size} ranks is no pipeline; use pp={world_size} "
                         "(or strategy=ddp for data parallelism)")


def check_tensor_parallel(name: str, plan: Any, dims: ParallelDims, model: str) -> None:
    """With tp > 1: the model has tensor-parallel styles, and tp divides the sizes they split."""
    if dims.tp <= 1:
        return
    if not plan.tp_plan and plan.tp_refusal:
        raise ValueError(f"{name}: {plan.tp_refusal}")
    if not plan.tp_plan:
        raise ValueError(f"{name}: tensor parallelism needs {model}'s tensor-parallel styles; declare "
                         "parallel_plan().tp_plan (module pattern -> colwise/rowwise/...; see README "
                         "'Use your own model') or set tp=1")
    check_tp_divisible(dims.tp, plan.tp_divisible)


def check_sequence_parallel(name: str, plan: Any, dims: ParallelDims, enabled: bool) -> None:
    """Sequence parallelism: a tensor-parallel axis, and a plan that names the norms it shards."""
    if not enabled:
        return
    if dims.tp > 1:
        check_sp_plan(plan.tp_plan)
    else:
        raise ValueError(f"{name}: sequence_parallel needs tensor parallelism (tp > 1), but tp=1")


def check_loss_parallel(name: str, module: nn.Module, dims: ParallelDims, enabled: bool) -> None:
    """Loss parallelism: a tensor-parallel axis, and the model's ``loss_fn``."""
    if not enabled:
        return
    if dims.tp <= 1:
        raise ValueError(f"{name}: loss_parallel needs tensor parallelism (tp > 1), but tp=1")
    if loss_fn_of(module) is None:
        raise ValueError(f"{name}: loss_parallel computes the loss itself and needs "
                         f"{type(module).__name__}.loss_fn(output, target)")


def check_expert_parallel(name: str, dims: ParallelDims, plan: Any, model: str) -> None:
    """With ep > 1: the model declares experts, and ep divides their number."""
    if dims.ep > 1:
        if not getattr(plan, "experts", ()):
            raise ValueError(f"{name}: ep={dims.ep} but {model} has no experts to spread over "
                             "ranks (its parallel_plan() declares no `experts`); use an MoE model or ep=1")
        check_expert_sizes(dims.ep, getattr(plan, "n_experts", 0), model)


def check_moe_sequence_parallel(name: str, plan: Any, model: str, sequence_parallel: bool) -> None:
    """Sequence parallelism with an MoE model, whatever ep is: refused (its MoE layers run whole on
    every tp rank and route whole sequences)."""
    if sequence_parallel and getattr(plan, "experts", ()):
        raise ValueError(f"{name}: sequence_parallel with an MoE model ({model}) is not supported (its MoE "
                         "layers run whole on every tp rank and route whole sequences); set sequence_parallel=false")
