"""Model parallelism composed on one ``DeviceMesh``: pipeline (PP) x tensor (TP) x data (DP) parallel.

``MeshParallelStrategy`` is the one Lightning strategy behind ``pipeline``, ``tensor_parallel``,
``fsdp_tp``, ``3d`` and ``expert_parallel``: each of those is this class with some axes switched on
(see ``pipeline.py``, ``tensor_parallel.py`` and ``expert_parallel.py`` for the one-axis presets,
and ``FSDPTPStrategy`` / ``Parallel3DStrategy`` below). The mesh is ``ParallelDims(pp, dp_replicate | dp_shard, tp)``;
``dp = world / (pp * tp)`` is inferred. This file decides the sizes, checks them, and says which
techniques to apply (``techniques``); ``parallel/parallelize.py`` applies them in the order of
techniques (docs/architecture.md): **cut stages** (``parallel/stages.py``: the model's ``layers``
cut into ``pp * virtual_stages`` stages, balanced by parameters or measured time, or at explicit
``split_points``), **tensor parallel** on each stage, **checkpoint activations**, **compile**,
**fully shard** over ``dp_shard`` (or, with ``data_parallel="replicate"``, gradients averaged over
``dp_replicate`` after backward), then **materialise** this rank's part. Running the schedule
inside Lightning's loop is ``pipeline_loop.py``.

Checkpoints use the strategy-neutral format of ``checkpoint.py`` (``torch.distributed.checkpoint``
directories, every tensor under the full model's parameter name, each rank writing what it holds),
so a pipeline or tensor-parallel checkpoint loads into any other layout or strategy.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from typing_extensions import override

from lightning_par import ConfigError
from lightning_par.optim import per_tensor_where_mixed
from lightning_par.parallel.contract import example_input_of, loss_fn_of
from lightning_par.parallel.discovery import ResolvedPlan, resolve_plan
from lightning_par.parallel.hf_pipeline import check_hf_pipeline
from lightning_par.parallel.hf_plan import check_tied
from lightning_par.parallel.layout import CostOptions
from lightning_par.parallel.mesh import ParallelDims, dp_coordinates
from lightning_par.parallel.expert_parallel import check_expert_parallel, data_mesh
from lightning_par.parallel.parallelize import ExpertParallel, TensorParallel
from lightning_par.parallel.pipeline import (
    MULTI_STAGE,
    SCHEDULES,
    Pipeline,
    balance_layers,
    build_schedule,
    build_stage_modules,
    layer_costs_by_params,
    stage_indices_for_rank,
    validate_pipeline,
)
from lightning_par.parallel.pipeline_ties import StageTie, broadcast_first_copy, plan_stage_ties
from lightning_par.parallel.ties import tied_parameters
from lightning_par.parallel.stages import (
    check_stage_starts,
    drop_remote_layers,
    measure_layer_times,
    n_stage_starts,
    resolve_split_points,
)
from lightning_par.parallel.tensor_parallel import check_sequence_parallel, check_tp_divisible
from lightning_par.strategies.base import ShardedStrategy, has_batchnorm
from lightning_par.strategies.checkpoint import canonical_fqn
from lightning_par.strategies.fsdp_options import FSDPOptions, FSDPOptionsMixin
from lightning_par.strategies.pipeline_loop import PipelineLoopMixin

log = logging.getLogger(__name__)

DATA_PARALLEL = ("replicate", "fsdp")
BALANCE = ("params", "time")


class MeshParallelStrategy(PipelineLoopMixin, FSDPOptionsMixin, ShardedStrategy):
    """Pipeline x tensor x data parallelism on one device mesh (see the module docstring).

    Args:
        pp: pipeline ranks (stages per replica, times ``virtual_stages``); None: the whole world.
        tp: tensor-parallel ranks; None: the whole world. At most one of pp / tp may be None;
            the data-parallel size is ``world / (pp * tp)``.
        data_parallel: ``replicate`` (gradients all-reduced over the dp axis) or ``fsdp``
            (parameters, gradients and optimizer state sharded over it with FSDP2).
        schedule: pipeline schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zb``, ``zbv``.
        n_microbatches: micro-batches per batch in the pipeline; None: one per pipeline rank.
        virtual_stages: stages per pipeline rank; None: 2 for interleaved_1f1b / zb / zbv, else 1.
        balance: how the layers are cut when no split points are given: ``params`` (equal
            parameter counts) or ``time`` (equal measured forward + backward time, on rank 0).
        split_points: explicit cut: the first layer of every stage after the first (index into the
            model's declared layers, or its path).
        sequence_parallel / loss_parallel: tensor-parallel options (see ``parallel/tensor_parallel.py``).
        activation_checkpointing: recompute each block's activations in backward.
        reshard_after_forward: FSDP: free gathered parameters after forward; None: True without a
            pipeline, False with one (else every micro-batch all-gathers them again).
        pipelined: run a pipeline schedule even when pp == 1 (the pipeline strategy on one device).
        ep: expert parallelism for MoE models (``parallel/expert_parallel.py``): the routed experts
            spread over ``ep`` ranks taken from the data axis (ep must divide world / (pp x tp)); the
            rest of the model as without it. The MoE layers run whole on every tensor-parallel rank.
        sync_batchnorm: BatchNorm statistics over the data-parallel ranks (as ``Trainer(sync_batchnorm=True)``);
            refused with a pipeline or sequence parallelism (see ``check_sync_batchnorm``).
    """

    strategy_name = "lp_mesh"

    def __init__(
        self,
        pp: int | None = 1,
        tp: int | None = 1,
        data_parallel: str = "replicate",
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        virtual_stages: int | None = None,
        balance: str = "params",
        split_points: Sequence[int | str] | None = None,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        activation_checkpointing: bool = False,
        reshard_after_forward: bool | None = None,
        pipelined: bool = False,
        ep: int = 1,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        sync_batchnorm: bool = False,
    ) -> None:
        super().__init__(activation_checkpointing=activation_checkpointing, process_group_backend=process_group_backend,
                         timeout=timeout, sync_batchnorm=sync_batchnorm)
        name = type(self).__name__
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
        self.pp, self.tp, self.ep = pp, tp, ep
        self._data_mesh: Any = None
        self.data_parallel = data_parallel
        self.schedule = schedule
        self._n_microbatches = n_microbatches
        if virtual_stages is None:
            virtual_stages = 2 if schedule in MULTI_STAGE else 1
        self.virtual_stages = virtual_stages
        self.balance = balance
        self.split_points = list(split_points) if split_points is not None else None
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.pipelined = pipelined
        # FSDP over dp_shard, with mixed precision as strategy=fsdp's: compute in param_dtype, keep the
        # sharded parameters (the master copy) in their own dtype
        self.fsdp_options = FSDPOptions(reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,
                                        reduce_dtype=reduce_dtype)
        self.fsdp_options.check(name)
        self._pipeline: Pipeline | None = None
        self._parallelized = False
        self._loss_scale = 1.0
        self._pending_grads: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        self._stage_ties: list[StageTie] = []  # a weight shared across pipeline ranks (pipeline_ties.py)

    # ----------------------------------------------------------------------------- sizes
    def _sizes(self, world_size: int) -> tuple[int, int, int]:
        """(pp, tp, dp) for ``world_size`` ranks; one-line ValueError when they do not fit."""
        name = type(self).__name__
        if self.pp is None or self.tp is None:
            known = self.tp if self.pp is None else self.pp
            if world_size % known:
                axis = "tp" if self.pp is None else "pp"
                raise ValueError(f"{name}: {axis}={known} does not divide the world size {world_size}; "
                                 f"use a multiple of {known} for trainer.devices x trainer.num_nodes")
            rest = world_size // known
            return (rest, known, 1) if self.pp is None else (known, rest, 1)
        if world_size % (self.pp * self.tp):
            on = [f"{k}={v}" for k, v in (("pp", self.pp), ("tp", self.tp)) if v > 1]
            sizes = " x ".join(on) + (f" = {self.pp * self.tp}" if len(on) > 1 else "")
            raise ValueError(f"{name}: {sizes} does not divide the world size {world_size}; choose sizes whose "
                             "product divides trainer.devices x trainer.num_nodes")
        return self.pp, self.tp, world_size // (self.pp * self.tp)

    @override
    def dims_for(self, world_size: int) -> ParallelDims:
        return self.mesh_dims(world_size, self.ep)

    def mesh_dims(self, world_size: int, ep: int) -> ParallelDims:
        """The mesh for ``world_size`` ranks with ``ep`` expert-parallel ranks taken from the data axis."""
        pp, tp, dp = self._sizes(world_size)
        if dp % ep:
            raise ValueError(f"{type(self).__name__}: ep={ep} does not divide the data-parallel degree {dp} "
                             f"(world {world_size} / (pp={pp} x tp={tp})); expert parallelism takes its ranks "
                             "from the data axis")
        dp //= ep
        if self.data_parallel == "fsdp":
            return ParallelDims(pp=pp, dp_shard=dp, ep=ep, tp=tp)
        return ParallelDims(pp=pp, dp_replicate=dp, ep=ep, tp=tp)

    def n_microbatches_for(self, pp: int) -> int:
        return self._n_microbatches if self._n_microbatches is not None else pp

    def cost_options(self) -> CostOptions:
        return replace(super().cost_options(), data_parallel=self.data_parallel, pipelined=bool(self.pipelined),
                       schedule=str(self.schedule), n_microbatches=self._n_microbatches,
                       virtual_stages=int(self.virtual_stages or 1), sequence_parallel=bool(self.sequence_parallel),
                       loss_parallel=bool(self.loss_parallel))

    def uses_pipeline(self, dims: ParallelDims) -> bool:
        return self.pipelined or dims.pp > 1

    # ------------------------------------------------------------------------ validation
    @override
    def validate_setup(self, world_size: int, module: nn.Module) -> None:
        """Everything checkable before processes start; one-line ``ValueError`` each."""
        super().validate_setup(world_size, module)  # the mesh, sync_batchnorm, activation checkpointing's blocks
        name = type(self).__name__
        dims = self.dims_for(world_size)
        plan = resolve_plan(module).plan
        model = type(module).__name__
        check_tied(module, tp=dims.tp, pp=dims.pp, layers=plan.layers)  # a layout that would untie shared weights
        if (self.param_dtype or self.reduce_dtype) and dims.dp_shard <= 1 and dims.ep > 1:
            raise ValueError(f"{name}: param_dtype/reduce_dtype need a dp_shard axis beside ep={dims.ep} (with none, "
                             "the experts stay outside FSDP, uncast); use trainer.precision=bf16-mixed instead")
        if (self.param_dtype or self.reduce_dtype) and dims.dp_shard <= 1:
            raise ValueError(f"{name}: param_dtype/reduce_dtype are FSDP mixed precision, but this layout has no "
                             f"FSDP axis (dp_shard={dims.dp_shard}); use trainer.precision=bf16-mixed instead")
        if self.uses_pipeline(dims):
            if not plan.layers and plan.pp_refusal:
                raise ValueError(f"{name}: pipeline: {plan.pp_refusal}")
            if not plan.layers:
                raise ValueError(f"{name}: pipeline parallelism needs to know where {model} may be cut; declare "
                                 "parallel_plan().layers (paths applied one after another, one tensor to one "
                                 "tensor; see README 'Use your own model')")
            if loss_fn_of(module) is None:
                raise ValueError(f"{name}: the pipeline's last stage needs {model}.loss_fn(output, target)")
            m = self.n_microbatches_for(dims.pp)
            n_stages = validate_pipeline(self.schedule, pp_size=dims.pp, n_microbatches=m,
                                         virtual_stages=self.virtual_stages,
                                         n_layers=n_stage_starts(plan.layers, plan.stage_starts),
                                         of_layers=len(plan.layers))
            # its stages run its own forward: refuse one that cannot
            check_hf_pipeline(module, plan.layers, starts=plan.stage_starts)
            if self.split_points is not None:
                resolve_split_points(plan.layers, self.split_points, n_stages, plan.stage_starts)
            elif self.balance == "time" and example_input_of(module) is None:
                raise ValueError(f"{name}: balance=time measures layers on {model}.example_input(batch_size), "
                                 "which it does not define; use balance=params or split_points")
            if self.loss_parallel:
                raise ValueError(f"{name}: loss_parallel is not supported with pipeline stages; "
                                 "set loss_parallel=false")
            if self.pipelined and dims.pp == 1 and world_size > 1:
                raise ValueError(f"{name}: pp=1 on {world_size} ranks is no pipeline; use pp={world_size} "
                                 "(or strategy=ddp for data parallelism)")
        if dims.tp > 1:
            if not plan.tp_plan and plan.tp_refusal:
                raise ValueError(f"{name}: {plan.tp_refusal}")
            if not plan.tp_plan:
                raise ValueError(f"{name}: tensor parallelism needs {model}'s tensor-parallel styles; declare "
                                 "parallel_plan().tp_plan (module pattern -> colwise/rowwise/...; see README "
                                 "'Use your own model') or set tp=1")
            check_tp_divisible(dims.tp, plan.tp_divisible)
            if self.sequence_parallel:
                check_sequence_parallel(plan.tp_plan)
        else:
            for option in ("sequence_parallel", "loss_parallel"):
                if getattr(self, option):
                    raise ValueError(f"{name}: {option} needs tensor parallelism (tp > 1), but tp=1")
        if self.loss_parallel and loss_fn_of(module) is None:
            raise ValueError(f"{name}: loss_parallel computes the loss itself and needs "
                             f"{model}.loss_fn(output, target)")
        self.check_experts(dims, plan, model)
        if self.sequence_parallel and getattr(plan, "experts", ()):  # whatever ep is
            raise ValueError(f"{name}: sequence_parallel with an MoE model ({model}) is not supported (its MoE "
                             "layers run whole on every tp rank and route whole sequences); set sequence_parallel=false")

    def check_experts(self, dims: ParallelDims, plan: Any, model: str) -> None:
        """With ep > 1: the model declares experts, and ep divides their number."""
        if dims.ep > 1:
            if not getattr(plan, "experts", ()):
                raise ValueError(f"{type(self).__name__}: ep={dims.ep} but {model} has no experts to spread over "
                                 "ranks (its parallel_plan() declares no `experts`); use an MoE model or ep=1")
            check_expert_parallel(dims.ep, getattr(plan, "n_experts", 0), model)

    def validate_batch(self, batch_size: int, world_size: int) -> None:
        """The batch one pipeline runs per step (global batch / (dp x accumulation)) must split into
        ``n_microbatches`` equal micro-batches."""
        dims = self.dims_for(world_size)
        m = self.n_microbatches_for(dims.pp)
        if self.uses_pipeline(dims) and batch_size % m:
            raise ValueError(f"{type(self).__name__}: the batch of {batch_size} samples per pipeline does not "
                             f"split into n_microbatches={m}; make data.global_batch_size / (dp={dims.dp} x "
                             f"accumulate_grad_batches) a multiple of {m}")

    # ----------------------------------------------------------------- Lightning plumbing
    # (process group, mesh from dims_for, sampler ranks from the dp axis, launcher, collectives and the
    # checkpoint format come from ShardedStrategy and DistributedCheckpointMixin)
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

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # one mesh over every data rank (dp axis x ep; flattened when both are there): what FSDP shards the
        # non-expert parameters over beside ep, and what replicated gradients are averaged over
        self._data_mesh = data_mesh(self.device_mesh)

    @override
    def setup(self, trainer: Any) -> None:
        if self.uses_pipeline(self.parallel_dims) and getattr(self.precision_plugin, "scaler", None) is not None:
            raise ConfigError(f"{type(self).__name__}: a pipeline runs backward inside its schedule and cannot use "
                              "16-mixed's gradient scaler; use bf16-mixed or 32-true")
        super().setup(trainer)
        self._use_global_norm_clipping()

    # ---------------------------------------------------------------- applying techniques
    @override
    def techniques(self, module: nn.Module, resolved: ResolvedPlan) -> dict[str, Any]:
        dims, mesh = self.parallel_dims, self.device_mesh
        out: dict[str, Any] = {}
        pipelined = self.uses_pipeline(dims)
        if pipelined:
            out["cut"] = lambda model: self._cut(model, resolved.plan.layers, resolved.plan.stage_starts)
        if dims.tp > 1:
            out["tensor_parallel"] = TensorParallel(mesh["tp"], sequence_parallel=self.sequence_parallel,
                                                    loss_parallel=self.loss_parallel and not pipelined)
        if dims.ep > 1:
            out["expert_parallel"] = ExpertParallel(mesh["ep"], experts=tuple(getattr(resolved.plan, "experts", ())),
                                                    fsdp_mesh=mesh["dp_shard"] if dims.dp_shard > 1 else None)
        if dims.dp_shard > 1 or (self.data_parallel == "fsdp" and dims.ep > 1):
            # beside ep, FSDP shards the non-expert parameters over every data rank (dp_shard x ep); the
            # experts over dp_shard, or (dp_shard = 1) not at all: they are split over ep already
            out["fully_shard"] = self.fsdp_options.technique(self.data_mesh() if dims.ep > 1 else mesh,
                                                             reshard_default=not pipelined)
        return out

    # ------------------------------------------------------------------ synchronized BatchNorm
    @override
    def sync_batchnorm_group(self) -> Any:
        """The data ranks' group (dp, times ep), not the tp / pp ranks (which read the same samples)."""
        dims = self.parallel_dims
        return None if dims.dp == dims.world_size else self.data_mesh().get_group()

    @override
    def check_sync_batchnorm(self, world_size: int, module: nn.Module) -> None:
        if not has_batchnorm(module):
            return
        name, dims = type(self).__name__, self.dims_for(world_size)
        if self.uses_pipeline(dims):
            raise ValueError(f"{name}: sync_batchnorm cannot give BatchNorm the statistics of the global batch under "
                             "a pipeline (each stage normalizes one micro-batch at a time); use a data-parallel "
                             "strategy, or GroupNorm/LayerNorm")
        if self.sequence_parallel:
            raise ValueError(f"{name}: sync_batchnorm with sequence_parallel would need BatchNorm statistics over the "
                             "tensor-parallel ranks too (they hold different tokens); set sequence_parallel=false")

    def data_mesh(self) -> Any:
        """One mesh over every data rank (dp axis x ep; ``parallel/expert_parallel.py``), built in
        ``setup_environment``."""
        if self._data_mesh is None:
            self._data_mesh = data_mesh(self.device_mesh)
        return self._data_mesh

    @override
    def prepare_model(self, module: nn.Module) -> list[nn.Module]:
        stages = super().prepare_model(module)
        broadcast_first_copy(module, self._stage_ties)  # materialised: the copies of a shared weight start equal
        if self.uses_pipeline(self.parallel_dims) and self._pipeline is None:
            self._pipeline = self._build_schedule(stages)
        return stages

    def _cut(self, module: nn.Module, layers: Sequence[str], starts: Sequence[int] = ()) -> list[nn.Module]:
        """The **cut stages** step of ``parallelize``: this rank's stage modules; other layers become
        ``RemoteLayer``s. A stage starts only at ``starts`` (``ParallelPlan.stage_starts``; () = anywhere)."""
        dims, mesh, trainer = self.parallel_dims, self.device_mesh, self.lightning_module.trainer
        layers = list(layers)
        m = self.n_microbatches_for(dims.pp)
        n_stages = dims.pp * self.virtual_stages
        micro = self._batch_per_pipeline(trainer, dims, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        if micro is not None:  # normally checked before processes start (validate_batch); here as a fallback
            try:
                self.validate_batch(micro, dims.world_size)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.split_points is not None:
            bounds = resolve_split_points(layers, self.split_points, n_stages, starts)
        elif self.balance == "time":  # measured on rank 0 (on a real copy of the model) and broadcast
            costs = None
            if self.global_rank == 0:
                costs = measure_layer_times(_measurable(module), layers,
                                            example_input_of(module)(max(1, (micro or m) // m), device=self.root_device),
                                            starts=starts)
            costs = self.broadcast(costs)
            bounds = balance_layers(costs, n_stages, starts)
        else:
            bounds = balance_layers(layer_costs_by_params(module, layers), n_stages, starts)
        check_stage_starts(layers, bounds, starts)
        pp_rank = mesh["pp"].get_local_rank() if dims.pp > 1 else 0
        indices = stage_indices_for_rank(self.schedule, pp_rank, dims.pp, self.virtual_stages)
        owner = {path: s for s in range(n_stages) for path in layers[bounds[s]:bounds[s + 1]]}
        if dims.pp > 1:  # a weight shared by layers on two pipeline ranks: a copy on each, kept equal
            rank_of_stage = {s: r for r in range(dims.pp)
                             for s in stage_indices_for_rank(self.schedule, r, dims.pp, self.virtual_stages)}
            self._stage_ties = plan_stage_ties(tied_parameters(module), layers, lambda p: rank_of_stage[owner[p]], mesh)
        stages = build_stage_modules(module, layers=layers, boundaries=bounds, stage_indices=indices)
        drop_remote_layers(module, layers, {path for stage in stages for path in stage.layers}, owner)
        log.info("%s: layers cut at %s; pipeline rank %d holds stages %s", type(self).__name__, bounds, pp_rank,
                 indices)
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
    # The shared format (strategies/checkpoint.py): model and optimizer state under the full model's
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

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        for opt in self.optimizers:  # experts on ep beside tp / FSDP shards (or plain tensors)
            per_tensor_where_mixed(opt)


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


# ---------------------------------------------------------------------------------------------
# The compositions


class FSDPTPStrategy(MeshParallelStrategy):
    """2-D parallelism: tensor parallel within groups of ``tp`` ranks, FSDP over the rest (dp_shard).

    Order (torchtitan): TP on the tp axis, then activation checkpointing, then ``fully_shard`` of
    the blocks and the root on the dp submesh -- parameters become 2-D DTensors (sharded over dp
    on dim 0, split over tp by the plan).
    """

    strategy_name = "lp_fsdp_tp"

    def __init__(self, tp: int = 2, sequence_parallel: bool = False, loss_parallel: bool = False,
                 activation_checkpointing: bool = False, reshard_after_forward: bool = True, **kwargs: Any) -> None:
        super().__init__(pp=1, tp=tp, data_parallel="fsdp", sequence_parallel=sequence_parallel,
                         loss_parallel=loss_parallel, activation_checkpointing=activation_checkpointing,
                         reshard_after_forward=reshard_after_forward, **kwargs)


class Parallel3DStrategy(MeshParallelStrategy):
    """3-D parallelism: pipeline stages (pp) x tensor parallel (tp) x data parallel (the rest).

    Order (torchtitan): cut the model into stages, apply TP to each stage module, then activation
    checkpointing, then FSDP (``data_parallel="fsdp"``) or plain gradient averaging
    (``"replicate"``) over the dp axis. Mesh axes, outermost first: pp, dp, tp (TP ranks are
    neighbours, i.e. on one node).
    """

    strategy_name = "lp_3d"

    def __init__(self, pp: int = 2, tp: int = 2, data_parallel: str = "fsdp", schedule: str = "1f1b",
                 n_microbatches: int | None = None, virtual_stages: int | None = None, balance: str = "params",
                 split_points: Sequence[int | str] | None = None, sequence_parallel: bool = False,
                 activation_checkpointing: bool = False, reshard_after_forward: bool | None = None,
                 **kwargs: Any) -> None:
        super().__init__(pp=pp, tp=tp, data_parallel=data_parallel, schedule=schedule, n_microbatches=n_microbatches,
                         virtual_stages=virtual_stages, balance=balance, split_points=split_points,
                         sequence_parallel=sequence_parallel, activation_checkpointing=activation_checkpointing,
                         reshard_after_forward=reshard_after_forward, **kwargs)


def _measurable(module: nn.Module) -> nn.Module:
    """``module`` itself, or a real (host) copy when it was built on the meta device: measuring layer
    times needs real tensors (rank 0 builds the copy; its values do not matter for timing)."""
    if not any(p.is_meta for p in module.parameters()):
        return module
    import copy

    real = copy.deepcopy(module).to_empty(device="cpu")
    for sub in real.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
    return real
