"""Model parallelism composed on one ``DeviceMesh``: pipeline (PP) x tensor (TP) x data (DP) parallel.

``MeshParallelStrategy`` is the one Lightning strategy behind ``pipeline``, ``tensor_parallel``,
``fsdp_tp``, ``3d`` and ``expert_parallel``: each of those is this class with some axes switched on
(see ``pipeline.py``, ``tensor_parallel.py`` and ``expert_parallel.py`` for the one-axis presets,
and ``FSDPTPStrategy`` / ``Parallel3DStrategy`` below). The mesh is ``ParallelDims(pp, dp_replicate | dp_shard, tp)``;
``dp = world / (pp * tp)`` is inferred. This file holds the strategy and its Lightning plumbing: it
decides the sizes (``mesh_checks.py``), checks them (``validate_setup``: the rules of each technique in
``mesh_checks.py``) and says which techniques to apply (``techniques``); ``parallel/parallelize.py``
applies them in the order of techniques (docs/architecture.md): **cut stages** (the model's ``layers``
cut into ``pp * virtual_stages`` stages -- balanced by parameters or measured time, or at explicit
``split_points`` -- as planned by ``pipeline_plan.py`` before ``parallelize``; ``mesh_pipeline.py``
plans, applies it and builds the schedule), **tensor parallel** on each stage, **checkpoint activations**,
**compile**, **fully shard** over ``dp_shard`` (or, with ``data_parallel="replicate"``, gradients
averaged over ``dp_replicate`` after backward), then **materialise** this rank's part. Running the
schedule inside Lightning's loop is ``pipeline_loop.py``.

Checkpoints use the strategy-neutral format of ``checkpoint.py`` (``torch.distributed.checkpoint``
directories, every tensor under the full model's parameter name, each rank writing what it holds),
so a pipeline or tensor-parallel checkpoint loads into any other layout or strategy (a pipeline's
optimizer ``param_groups`` merged over its ranks: ``mesh_pipeline.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn
from typing_extensions import override

from lightning_par import ConfigError
from lightning_par.core.optim import per_tensor_where_mixed
from lightning_par.parallel.discovery import ResolvedPlan, resolve_plan
from lightning_par.parallel.tensor.expert_parallel import data_mesh
from lightning_par.parallel.hf.plan import check_tied
from lightning_par.parallel.layout import CostOptions
from lightning_par.parallel.mesh import ParallelDims
from lightning_par.parallel.parallelize import ExpertParallel, TensorParallel
from lightning_par.parallel.pipeline.schedule import MULTI_STAGE, Pipeline
from lightning_par.parallel.pipeline.stage_ties import StageTie, broadcast_first_copy
from lightning_par.strategies.base import ShardedStrategy, has_batchnorm
from lightning_par.strategies.fsdp_options import FSDPOptions, FSDPOptionsMixin
from lightning_par.strategies.mesh_checks import (  # noqa: F401  (BALANCE, DATA_PARALLEL: the options, named here)
    BALANCE,
    DATA_PARALLEL,
    check_expert_parallel,
    check_fsdp,
    check_loss_parallel,
    check_moe_sequence_parallel,
    check_options,
    check_pipeline,
    check_sequence_parallel,
    check_tensor_parallel,
    mesh_dims,
)
from lightning_par.strategies.mesh_pipeline import MeshPipelineMixin
from lightning_par.strategies.pipeline_loop import PipelineLoopMixin

log = logging.getLogger(__name__)


class MeshParallelStrategy(MeshPipelineMixin, PipelineLoopMixin, FSDPOptionsMixin, ShardedStrategy):
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
        sequence_parallel / loss_parallel: tensor-parallel options (see ``parallel/tensor/tensor_parallel.py``).
        activation_checkpointing: true or "full" recomputes each block in backward, "selective" keeps matmuls,
            k (an int) recomputes every k-th block.
        reshard_after_forward: FSDP: free gathered parameters after forward; None: True without a
            pipeline, False with one (else every micro-batch all-gathers them again).
        pipelined: run a pipeline schedule even when pp == 1 (the pipeline strategy on one device).
        ep: expert parallelism for MoE models (``parallel/tensor/expert_parallel.py``): the routed experts
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
        activation_checkpointing: bool | str = False,
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
        check_options(name, pp=pp, tp=tp, data_parallel=data_parallel, ep=ep, schedule=schedule, balance=balance)
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
        self._stage_ties: list[StageTie] = []  # a weight shared across pipeline ranks (pipeline/stage_ties.py)

    # ----------------------------------------------------------------------------- sizes
    @override
    def dims_for(self, world_size: int) -> ParallelDims:
        return self.mesh_dims(world_size, self.ep)

    def mesh_dims(self, world_size: int, ep: int) -> ParallelDims:
        """The mesh for ``world_size`` ranks with ``ep`` expert-parallel ranks taken from the data axis
        (``mesh_checks.mesh_dims``)."""
        return mesh_dims(type(self).__name__, pp=self.pp, tp=self.tp, ep=ep, data_parallel=self.data_parallel,
                         world_size=world_size)

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
        """Everything checkable before processes start; one-line ``ValueError`` each. The rules of each
        technique are in ``mesh_checks.py``, checked in this order."""
        super().validate_setup(world_size, module)  # the mesh, sync_batchnorm, activation checkpointing's blocks
        name, dims, plan, model = type(self).__name__, self.dims_for(world_size), resolve_plan(module).plan, \
            type(module).__name__
        check_tied(module, tp=dims.tp, pp=dims.pp, layers=plan.layers)  # a layout that would untie shared weights
        check_fsdp(name, dims, param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)
        if self.uses_pipeline(dims):
            check_pipeline(name, module, plan, dims, world_size, schedule=self.schedule,
                           n_microbatches=self.n_microbatches_for(dims.pp), virtual_stages=self.virtual_stages,
                           split_points=self.split_points, balance=self.balance, loss_parallel=self.loss_parallel,
                           pipelined=self.pipelined)
        check_tensor_parallel(name, plan, dims, model)
        check_sequence_parallel(name, plan, dims, self.sequence_parallel)
        check_loss_parallel(name, module, dims, self.loss_parallel)
        self.check_experts(dims, plan, model)
        check_moe_sequence_parallel(name, plan, model, self.sequence_parallel)

    def check_experts(self, dims: ParallelDims, plan: Any, model: str) -> None:
        """With ep > 1: the model declares experts, and ep divides their number (``ExpertParallelStrategy``
        asks for experts whatever ep is)."""
        check_expert_parallel(type(self).__name__, dims, plan, model)

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
    def weight_splits(self, world_size: int) -> list[str]:
        dims = self.dims_for(world_size)
        return [name for name, on in (("fully_shard", dims.dp_shard > 1 or dims.ep > 1), ("tensor_parallel", dims.tp > 1))
                if on]

    def techniques(self, module: nn.Module, resolved: ResolvedPlan) -> dict[str, Any]:
        dims, mesh = self.parallel_dims, self.device_mesh
        out: dict[str, Any] = {}
        pipelined = self.uses_pipeline(dims)
        if pipelined:  # the cut is decided now, before parallelize; its "cut stages" step only applies it
            cut = self.plan_pipeline(module, resolved.plan)
            out["cut"] = lambda model: self._cut(model, cut)
        if dims.tp > 1:
            out["tensor_parallel"] = TensorParallel(mesh["tp"], sequence_parallel=self.sequence_parallel,
                                                    loss_parallel=self.loss_parallel and not pipelined)
        if dims.ep > 1:
            out["expert_parallel"] = ExpertParallel(mesh["ep"], experts=resolved.plan.experts,
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
        """One mesh over every data rank (dp axis x ep; ``parallel/tensor/expert_parallel.py``), built in
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

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        for opt in self.optimizers:  # experts on ep beside tp / FSDP shards (or plain tensors)
            per_tensor_where_mixed(opt)


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
                 activation_checkpointing: bool | str = False, reshard_after_forward: bool = True, **kwargs: Any) -> None:
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
                 activation_checkpointing: bool | str = False, reshard_after_forward: bool | None = None,
                 **kwargs: Any) -> None:
        super().__init__(pp=pp, tp=tp, data_parallel=data_parallel, schedule=schedule, n_microbatches=n_microbatches,
                         virtual_stages=virtual_stages, balance=balance, split_points=split_points,
                         sequence_parallel=sequence_parallel, activation_checkpointing=activation_checkpointing,
                         reshard_after_forward=reshard_after_forward, **kwargs)

