"""Model parallelism composed on one ``DeviceMesh``: pipeline (PP) x tensor (TP) x data (DP) parallel.

``MeshParallelStrategy`` is the one Lightning strategy behind ``pipeline``, ``tensor_parallel``,
``fsdp_tp`` and ``3d``: each of those is this class with some axes switched on (see
``pipeline.py`` and ``tensor_parallel.py`` for the one-axis presets, and ``FSDPTPStrategy`` /
``Parallel3DStrategy`` below). The mesh is ``ParallelDims(pp, dp_replicate | dp_shard, tp)``;
``dp = world / (pp * tp)`` is inferred. In ``setup`` (processes exist, optimizers not yet built),
the techniques are applied in torchtitan's order:

1. **PP cut**: the model's declared ``layers`` are cut into ``pp * virtual_stages`` stages
   (balanced by parameters or measured time, or at explicit ``split_points``). This rank keeps its
   stages; every other layer is replaced in the LightningModule by a parameter-free
   ``RemoteLayer``, so ``configure_optimizers`` sees only local parameters and the module's
   ``state_dict`` holds only this rank's part, under the full model's names.
2. **TP** on each stage (or the whole model): the model's ``tp_plan`` on the ``tp`` axis.
3. **Activation checkpointing** of the declared blocks (those present on this rank).
4. **FSDP** (``data_parallel="fsdp"``: ``fully_shard`` over the ``dp_shard`` axis, blocks as
   units) or **plain data parallel** (``"replicate"``: gradients averaged over ``dp_replicate``
   by one bucketed all-reduce after backward).

Pipelines inside Lightning's loop. Lightning's automatic optimization runs, per batch,
``training_step`` -> ``zero_grad`` (first batch of an accumulation window) -> ``backward``. A
pipeline schedule runs forward *and* backward of all micro-batches in one call, so here
``training_step`` runs the schedule and returns the (detached) mean micro-batch loss, the same on
every pipeline rank, which it also logs as ``train/loss``. The gradients it produced are set aside
before Lightning's ``zero_grad`` and handed back to the parameters in ``backward`` -- which runs
no autograd of its own, only the hooks around it -- so clipping, ``on_after_backward`` and the
optimizer see them as usual. Loss scaling: torch's schedule would divide *all* gradients by the
number of micro-batches after every call (wrong under gradient accumulation), so it is switched off
and each micro-batch loss is scaled by ``1 / (n_microbatches * accumulate_grad_batches)`` instead.
``validation_step`` runs the forward-only schedule and logs ``val/loss``.

Gradient clipping uses the norm of the whole model's gradient: DTensor gradients (TP, FSDP) give
their norm over their mesh, and the pipeline ranks' partial norms are combined over the ``pp``
axis (torchtitan's ``clip_grad_norm_``). Checkpoints use the strategy-neutral format of
``checkpoint.py`` (``torch.distributed.checkpoint`` directories, every tensor under the full
model's parameter name, each rank writing what it holds), so a pipeline or tensor-parallel
checkpoint loads into any other layout or strategy, and the training data resumes mid-epoch.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_par import ConfigError
from lightning_par.parallel.checkpointing import apply_activation_checkpointing
from lightning_par.parallel.fsdp import apply_fsdp
from lightning_par.parallel.mesh import ParallelDims, dp_coordinates
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
from lightning_par.parallel.tensor_parallel import apply_tensor_parallel, check_tp_divisible, loss_parallel_context
from lightning_par.strategies.base import ShardedStrategy, local_tensor, model_plan
from lightning_par.strategies.checkpoint import canonical_fqn

log = logging.getLogger(__name__)

DATA_PARALLEL = ("replicate", "fsdp")
BALANCE = ("params", "time")


# ---------------------------------------------------------------------------------------------
# Helpers (plain torch, used by the strategy)


class RemoteLayer(nn.Module):
    """Stands in, inside this rank's LightningModule, for a layer that lives on another pipeline rank."""

    def __init__(self, path: str, stage: int) -> None:
        super().__init__()
        self.path, self.stage = path, stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"layer {self.path!r} lives on pipeline stage {self.stage} (another rank); "
                           "run the model through the pipeline strategy's training/validation step")

    def extra_repr(self) -> str:
        return f"{self.path} -> stage {self.stage}"


def _replace_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    parent._modules[leaf] = new


def resolve_split_points(layers: Sequence[str], split_points: Sequence[int | str], n_stages: int) -> list[int]:
    """Stage boundaries ``[0, ..., len(layers)]`` from split points: the first layer of every stage
    after the first, as an index into ``layers`` or a layer path (``net.blocks.4``; the unique layer
    ending in ``.blocks.4`` also matches ``blocks.4``)."""
    layers = list(layers)
    cuts = []
    for point in split_points:
        if isinstance(point, int) and not isinstance(point, bool):
            cuts.append(point)
            continue
        name = str(point)
        matches = [i for i, path in enumerate(layers) if path == name] or \
                  [i for i, path in enumerate(layers) if path.endswith("." + name)]
        if len(matches) != 1:
            raise ValueError(f"split point {name!r} is not one of the model's layers ({', '.join(layers)})")
        cuts.append(matches[0])
    if len(cuts) != n_stages - 1:
        raise ValueError(f"split_points: {n_stages} pipeline stages need {n_stages - 1} split points, got {len(cuts)}")
    bounds = [0, *cuts, len(layers)]
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"split_points must be increasing layer indices between 1 and {len(layers) - 1}, got {cuts}")
    return bounds


def measure_layer_times(module: nn.Module, layers: Sequence[str], example: torch.Tensor,
                        repeats: int = 3) -> list[float]:
    """Seconds of forward + backward of every layer on ``example`` (median of ``repeats`` runs after a
    warm-up), layer by layer: the costs for a compute-balanced pipeline cut."""
    times: list[list[float]] = [[] for _ in layers]
    sync = torch.cuda.synchronize if example.device.type == "cuda" else (lambda: None)
    for run in range(repeats + 1):
        h = example
        for i, path in enumerate(layers):
            x = h.detach().requires_grad_() if h.is_floating_point() else h
            sync()
            start = time.perf_counter()
            out = module.get_submodule(path)(x)
            out.float().sum().backward()
            sync()
            if run:
                times[i].append(time.perf_counter() - start)
            h = out.detach()
    module.zero_grad(set_to_none=True)
    return [statistics.median(t) for t in times]


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, *, norm_type: float = 2.0,
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model spread over ranks; returns the total norm.

    The norm is that of the *whole* model's gradient: DTensor gradients (TP shards, FSDP shards) give
    their full norm over their own mesh; the ranks of a pipeline hold different stages, so their
    norms are combined over ``pp_group`` (sum of p-th powers, or max for the inf-norm).
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if grads:
        total = torch.nn.utils.get_total_norm(grads, norm_type)
        if isinstance(total, DTensor):
            total = total.full_tensor()
    else:
        total = torch.zeros(())
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total.double() ** norm_type
            dist.all_reduce(total, group=pp_group)
            total = (total ** (1.0 / norm_type)).float()
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def average_gradients(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average the gradients (local shards of DTensor gradients) over ``group``: one all-reduce per
    dtype of all of them flattened together (plain data parallelism, no overlap with backward)."""
    size = dist.get_world_size(group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            g = local_tensor(p.grad)
            by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


# ---------------------------------------------------------------------------------------------
# The strategy


class MeshParallelStrategy(ShardedStrategy):
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
        activation_checkpointing: recompute each declared block's activations in backward.
        reshard_after_forward: FSDP: free gathered parameters after forward; None: True without a
            pipeline, False with one (else every micro-batch all-gathers them again).
        pipelined: run a pipeline schedule even when pp == 1 (the pipeline strategy on one device).
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
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(activation_checkpointing=activation_checkpointing, process_group_backend=process_group_backend,
                         timeout=timeout)
        name = type(self).__name__
        if pp is None and tp is None:
            raise ValueError(f"{name}: at most one of pp and tp may be null (= the rest of the world)")
        for key, value in (("pp", pp), ("tp", tp)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}: {key} must be a positive integer or null, got {value!r}")
        if data_parallel not in DATA_PARALLEL:
            raise ValueError(f"{name}: data_parallel must be one of {', '.join(DATA_PARALLEL)}, got {data_parallel!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"{name}: unknown pipeline schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
        if balance not in BALANCE:
            raise ValueError(f"{name}: balance must be one of {', '.join(BALANCE)}, got {balance!r}")
        self.pp, self.tp = pp, tp
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
        self.reshard_after_forward = reshard_after_forward
        self.pipelined = pipelined
        self._pipeline: Pipeline | None = None
        self._parallelized = False
        self._loss_scale = 1.0
        self._pending_grads: list[tuple[nn.Parameter, torch.Tensor | None]] = []

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
        pp, tp, dp = self._sizes(world_size)
        if self.data_parallel == "fsdp":
            return ParallelDims(pp=pp, dp_shard=dp, tp=tp)
        return ParallelDims(pp=pp, dp_replicate=dp, tp=tp)

    def n_microbatches_for(self, pp: int) -> int:
        return self._n_microbatches if self._n_microbatches is not None else pp

    def uses_pipeline(self, dims: ParallelDims) -> bool:
        return self.pipelined or dims.pp > 1

    # ------------------------------------------------------------------------ validation
    @override
    def validate_setup(self, world_size: int, module: nn.Module) -> None:
        """Everything checkable before processes start; one-line ``ValueError`` each."""
        name = type(self).__name__
        dims = self.dims_for(world_size)
        dims.validate(world_size)
        plan = model_plan(module)
        model = type(module).__name__
        if self.uses_pipeline(dims):
            if plan is None or not plan.layers:
                raise ValueError(f"{name}: pipeline parallelism needs a model that declares its layers "
                                 f"(parallel_plan().layers); {model} declares none")
            if not callable(getattr(module, "loss_fn", None)):
                raise ValueError(f"{name}: the pipeline's last stage needs {model}.loss_fn(output, target)")
            m = self.n_microbatches_for(dims.pp)
            n_stages = validate_pipeline(self.schedule, pp_size=dims.pp, n_microbatches=m,
                                         virtual_stages=self.virtual_stages, n_layers=len(plan.layers))
            if self.split_points is not None:
                resolve_split_points(plan.layers, self.split_points, n_stages)
            elif self.balance == "time" and not callable(getattr(module, "example_input", None)):
                raise ValueError(f"{name}: balance=time measures layers on {model}.example_input(batch_size), "
                                 "which it does not define; use balance=params or split_points")
            if self.loss_parallel:
                raise ValueError(f"{name}: loss_parallel is not supported with pipeline stages; "
                                 "set loss_parallel=false")
            if self.pipelined and dims.pp == 1 and world_size > 1:
                raise ValueError(f"{name}: pp=1 on {world_size} ranks is no pipeline; use pp={world_size} "
                                 "(or strategy=ddp for data parallelism)")
        if dims.tp > 1:
            if plan is None or not plan.tp_plan:
                raise ValueError(f"{name}: tensor parallelism needs a plan, but {model} declares no tp_plan "
                                 "(parallel_plan().tp_plan); use a model with one or set tp=1")
            check_tp_divisible(dims.tp, plan.tp_divisible)
        else:
            for option in ("sequence_parallel", "loss_parallel"):
                if getattr(self, option):
                    raise ValueError(f"{name}: {option} needs tensor parallelism (tp > 1), but tp=1")
        if self.loss_parallel and not callable(getattr(module, "loss_fn", None)):
            raise ValueError(f"{name}: loss_parallel computes the loss itself and needs "
                             f"{model}.loss_fn(output, target)")
        if self.activation_checkpointing and (plan is None or not plan.blocks):
            raise ValueError(f"{name}: activation_checkpointing needs a model that declares its blocks "
                             f"(parallel_plan().blocks); {model} declares none")

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

    _checkpoint_before_parallelize = False  # _parallelize applies it after TP

    @override
    def setup(self, trainer: Any) -> None:
        if self.uses_pipeline(self.parallel_dims) and getattr(self.precision_plugin, "scaler", None) is not None:
            raise ConfigError(f"{type(self).__name__}: a pipeline runs backward inside its schedule and cannot use "
                              "16-mixed's gradient scaler; use bf16-mixed or 32-true")
        super().setup(trainer)
        self._use_global_norm_clipping()

    @override
    def parallelize(self, module: nn.Module) -> None:
        if not self._parallelized:  # once: fit followed by validate must not cut the model again
            self._parallelize(self.lightning_module.trainer)
            self._parallelized = True

    # ---------------------------------------------------------------- applying techniques
    def _parallelize(self, trainer: Any) -> None:
        module = self.lightning_module
        assert module is not None
        dims = self.parallel_dims
        plan = model_plan(module)
        if self.uses_pipeline(dims):
            self._pipeline = self._build_pipeline(module, plan, trainer)
            return
        mesh = self.device_mesh
        # torchtitan's order: TP, then activation checkpointing, then FSDP / data parallel
        if dims.tp > 1:
            apply_tensor_parallel(module, tp_mesh=mesh["tp"], plan=plan.tp_plan,
                                  sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel,
                                  divisible=plan.tp_divisible)
        self._apply_activation_checkpointing(module)
        if dims.dp_shard > 1:
            root, prefix = _fsdp_root(module, plan)
            units = [b[len(prefix):] for b in (plan.blocks if plan else ())]
            apply_fsdp(root, mesh=mesh, units=units,
                       reshard_after_forward=True if self.reshard_after_forward is None else self.reshard_after_forward)
            log.info("%s: FSDP over dp_shard=%d, %d units", type(self).__name__, dims.dp_shard, len(units))

    def _build_pipeline(self, module: nn.Module, plan: Any, trainer: Any) -> Pipeline:
        dims, mesh = self.parallel_dims, self.device_mesh
        layers = list(plan.layers)
        m = self.n_microbatches_for(dims.pp)
        n_stages = dims.pp * self.virtual_stages
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        micro = self._batch_per_pipeline(trainer, dims, accumulate)
        if micro is not None:  # normally checked before processes start (validate_batch); here as a fallback
            try:
                self.validate_batch(micro, dims.world_size)
            except ValueError as e:
                raise ConfigError(str(e)) from None

        # 1. PP cut: the same boundaries on every rank (time costs are measured on rank 0 and broadcast)
        if self.split_points is not None:
            bounds = resolve_split_points(layers, self.split_points, n_stages)
        else:
            if self.balance == "time":
                costs = None
                if self.global_rank == 0:
                    example = module.example_input(max(1, (micro or m) // m), device=self.root_device)
                    costs = measure_layer_times(module, layers, example)
                costs = self.broadcast(costs)
            else:
                costs = layer_costs_by_params(module, layers)
            bounds = balance_layers(costs, n_stages)
        pp_rank = mesh["pp"].get_local_rank() if dims.pp > 1 else 0
        indices = stage_indices_for_rank(self.schedule, pp_rank, dims.pp, self.virtual_stages)
        stages = build_stage_modules(module, layers=layers, boundaries=bounds, stage_indices=indices)
        owner = {path: s for s in range(n_stages) for path in layers[bounds[s]:bounds[s + 1]]}
        local = {path for stage in stages for path in stage.layers}
        for path in layers:
            if path not in local:  # configure_optimizers and state_dict see only this rank's layers
                _replace_submodule(module, path, RemoteLayer(path, owner[path]))
        log.info("%s: layers cut at %s; pipeline rank %d holds stages %s", type(self).__name__, bounds, pp_rank,
                 indices)

        for stage in stages:
            # 2. TP inside each stage (the plan's paths are the full model's, as are the stage's)
            if dims.tp > 1:
                apply_tensor_parallel(stage, tp_mesh=mesh["tp"], plan=plan.tp_plan,
                                      sequence_parallel=self.sequence_parallel, loss_parallel=False,
                                      divisible=plan.tp_divisible, strict=False)
            blocks = [b for b in plan.blocks if any(b == p or b.startswith(p + ".") for p in stage.layers)]
            # 3. activation checkpointing of the stage's blocks
            if self.activation_checkpointing:
                apply_activation_checkpointing(stage, blocks=blocks)
            # 4. FSDP over the dp axis, the stage as root (torch's pipeline runs FSDP's gradient sync)
            if dims.dp_shard > 1:
                apply_fsdp(stage, mesh=mesh, units=blocks, reshard_after_forward=bool(self.reshard_after_forward))

        self._loss_scale = 1.0 / (m * accumulate)
        pipe = build_schedule(stages, schedule=self.schedule, n_microbatches=m, loss_fn=self._scaled_loss,
                              pp_group=mesh["pp"] if dims.pp > 1 else None, virtual_stages=self.virtual_stages,
                              stage_indices=indices, device=self.root_device)
        # the loss is scaled instead: torch's scaling divides every gradient after each call, which
        # would also shrink the gradients accumulated over earlier batches
        pipe.schedule.scale_grads = False  # type: ignore[attr-defined]
        return pipe

    def _batch_per_pipeline(self, trainer: Any, dims: ParallelDims, accumulate: int) -> int | None:
        gbs = getattr(getattr(trainer, "datamodule", None), "global_batch_size", None)
        if not gbs or gbs % (dims.dp * accumulate):
            return None
        return gbs // (dims.dp * accumulate)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.lightning_module.loss_fn(output, target) * self._loss_scale

    # -------------------------------------------------------------------- the loop
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline_training_step(args[0], args[1])
        if self.loss_parallel:
            return self._loss_parallel_step(args[0], "train/loss")
        return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            x, y = args[0]
            with self.precision_plugin.val_step_context():
                loss = self._pipeline.eval_step(x, y) / self._loss_scale
            self.lightning_module.log("val/loss", loss, prog_bar=True, sync_dist=True)
            return loss
        if self.loss_parallel:
            return self._loss_parallel_step(args[0], "val/loss")
        return super().validation_step(*args, **kwargs)

    def _pipeline_training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        pipe, module = self._pipeline, self.lightning_module
        assert pipe is not None and module is not None
        x, y = batch
        params = [p for p in module.parameters() if p.requires_grad]
        first = batch_idx % max(1, self.lightning_module.trainer.accumulate_grad_batches) == 0
        if first:  # last step's gradients: Lightning zeroes them right after this hook anyway
            for p in params:
                p.grad = None
        with self.precision_plugin.train_step_context():
            loss = pipe.step(x, y) / self._loss_scale  # forward + backward of every micro-batch
        if first:  # set aside from Lightning's zero_grad; backward() hands them back
            self._pending_grads = [(p, p.grad) for p in params]
            for p in params:
                p.grad = None
        module.log("train/loss", loss, prog_bar=True)
        return loss

    def _loss_parallel_step(self, batch: Any, name: str) -> torch.Tensor:
        """Forward, then the model's loss on vocabulary-sharded logits (no gather of the logits)."""
        module = self.lightning_module
        x, y = batch
        context = self.precision_plugin.train_step_context() if name.startswith("train") \
            else self.precision_plugin.val_step_context()
        with context:
            out = module(x)
            with loss_parallel_context(True):
                loss = module.loss_fn(out, y)
                if isinstance(loss, DTensor):
                    loss = loss.full_tensor()
        module.log(name, loss.detach(), prog_bar=True, sync_dist=name.startswith("val"))
        return loss

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if self._pipeline is not None:
            # the schedule already ran backward inside training_step: hand its gradients over
            for p, g in self._pending_grads:
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g
            self._pending_grads = []
        else:
            with loss_parallel_context(self.loss_parallel):
                self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        dims = self.parallel_dims
        if dims.dp_replicate > 1:
            # averaging the whole accumulated gradient after every backward is exact: the part
            # averaged before is already equal on every replica
            average_gradients(module.parameters(), self.device_mesh["dp_replicate"].get_group())
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _use_global_norm_clipping(self) -> None:
        """Make Lightning's norm clipping (``gradient_clip_val``) use the whole model's norm. Lightning
        calls the precision plugin's ``clip_grad_by_norm``; this strategy owns that plugin instance."""
        pp_group = self.device_mesh["pp"].get_group() if self.parallel_dims.pp > 1 else None
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            clip_grad_norm_(plugin.main_params(optimizer), clip_val, pp_group=pp_group)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    @override
    def teardown(self) -> None:
        self._pipeline = None
        self._pending_grads = []
        super().teardown()

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

    @override
    def describe(self) -> dict[str, Any]:
        out = super().describe()
        if self.uses_pipeline(self.parallel_dims):
            out.update(schedule=self.schedule, n_microbatches=self.n_microbatches_for(self.parallel_dims.pp),
                       virtual_stages=self.virtual_stages)
        return out


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


def _fsdp_root(module: nn.Module, plan: Any) -> tuple[nn.Module, str]:
    """The submodule holding all the plan's layers and blocks (``net`` of a ParModule) and its path
    prefix: FSDP's root unit. Falls back to the module itself."""
    paths = list(plan.layers) + list(plan.blocks) if plan else []
    heads = {p.split(".", 1)[0] for p in paths if "." in p}
    if len(heads) == 1 and all("." in p for p in paths):
        head = heads.pop()
        if sum(1 for _ in module.parameters()) == sum(1 for _ in module.get_submodule(head).parameters()):
            return module.get_submodule(head), head + "."
    return module, ""


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
