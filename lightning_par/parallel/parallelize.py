"""The one place where techniques are applied to a model, in one order (torchtitan's ``parallelize_*``).

Every strategy and every pipeline stage goes through ``parallelize(module, spec)``. It runs the
steps of docs/architecture.md's "Order of techniques" (the one list of them) from **build on
meta** to **materialise**; each is marked with its name in the code below:

- **build on meta**: remember how to initialise the model (meta copies of its init groups,
  ``materialize.py``, and where its tensors came from in the constructor's recorded calls,
  ``init_trace.py``), or, for a model built with real tensors, move it to the device;
- **tile**: the layers named in ``spec.tiling`` (``tiling.py``: a large ``nn.Linear`` becomes k
  tiles computed in turn; each tile is checkpointed in **checkpoint activations** and is an FSDP
  unit in **fully shard**; a tied embedding and head are tiled together, each tile one module and
  one unit used by both);
- **cut stages**: ``spec.cut`` keeps this rank's pipeline stages and drops the other layers;
- **float8**: ``spec.float8``: the stage's linear layers (not its output head) compute in float8
  (``precision/float8.py``, torchao's ``Float8Linear``), before tensor parallelism and FSDP as torchao asks;
- **tensor parallel** on each stage (or the whole model), then **expert parallel**
  (``spec.expert_parallel``: the routed experts sharded over the ep axis, ``expert_parallel.py``);
- **checkpoint activations** of the blocks present (and of the tiles);
- **compile** each block (``module.compile()`` in place: state-dict keys do not change), or with
  ``compile_scope="model"`` each stage whole and the model's ``loss_fn`` (``compile_model``);
- **quantize base**: ``spec.quantize_base="nf4"`` (QLoRA): each LoRA layer's frozen weight becomes torchao's NF4
  (``adapters/lora.py``), on meta, so that FSDP splits and gathers it in 4 bits;
- **fully shard**: FSDP2 ``fully_shard`` (the expert modules over their own data axis -- or, with
  none beside ep, left out of FSDP -- then units, then the stage/model root);
- **materialise**: allocate only this rank's local tensors and fill them with the model's own,
  layout-independent initialisation -- or, for a model declaring pretrained weights, with this
  rank's slices of the checkpoint (``pretrained.py``).

**wrap DDP** and **build optimizer** come after, in the strategy (Lightning's DDP wrapper broadcasts
rank 0's parameters when it is built, so it needs materialised parameters; optimizers need the final
parameters). Each step is a plain-torch function of its own module; this function only fixes the
order and decides what each step sees.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_par.parallel.memory.checkpointing import apply_activation_checkpointing, every_kth
from lightning_par.parallel.memory.chunked_loss import chunked_head
from lightning_par.parallel.contract import loss_fn_of
from lightning_par.parallel.discovery import ResolvedPlan, init_groups
from lightning_par.parallel.tensor.expert_parallel import apply_expert_parallel, shard_experts
from lightning_par.parallel.sharding.fsdp import apply_fsdp, resolve_units
from lightning_par.parallel.init.init_trace import InitTrace, tensor_refs
from lightning_par.parallel.adapters.lora import check_nf4_split, quantize_bases
from lightning_par.parallel.init.materialize import InitFn, capture_templates, has_meta_tensors, materialize
from lightning_par.parallel.init.weights import weight_sources
from lightning_par.parallel.tensor.tensor_parallel import apply_tensor_parallel
from lightning_par.parallel.memory.tiling import apply_tiling, check_tiling, with_tied_partners
from lightning_par.parallel.precision.float8 import Float8, apply_float8, output_layers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallel:
    mesh: DeviceMesh
    sequence_parallel: bool = False
    loss_parallel: bool = False


@dataclass(frozen=True)
class FullyShard:
    mesh: DeviceMesh
    #: module paths, a class name or a minimum parameter count (``fsdp.resolve_units``), resolved when
    #: FSDP is applied; None: the plan's blocks present in the module
    units: str | int | Sequence[str] | None = None
    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cpu_offload: bool = False
    prefetch: int = 1
    #: the disk tier of the offload (``disk_offload.FileTier``): the parameter shards are homed in its
    #: files when materialised, which it releases page by page (None: host memory)
    disk_tier: Any = None


@dataclass(frozen=True)
class ExpertParallel:
    mesh: DeviceMesh  #: the ep axis
    experts: tuple[str, ...]  #: the expert modules (paths in the model)
    #: the data axis beside ep that FSDP shards the experts over (None: not sharded further, and kept
    #: out of the model's FSDP units: their gradient is already the ep group's mean, ``Experts.grad_scale``)
    fsdp_mesh: DeviceMesh | None = None


@dataclass(frozen=True)
class Techniques:
    """What to apply; ``None``/``False`` skips a step."""

    device: torch.device
    plan: ResolvedPlan
    seed: int = 0
    init_fn: InitFn | None = None
    #: tile: module path -> tile count (``tiling.py``), e.g. ``{"net.head.lm_head": 4}``
    tiling: dict[str, int] = field(default_factory=dict)
    #: build on meta: what the constructor did to the meta tensors (``init_trace.py``), replayed for the
    #: tensors that no init function sets
    init_trace: InitTrace | None = None
    #: cut stages: takes the whole model, returns this rank's stage modules (sharing its submodules)
    cut: Callable[[nn.Module], list[nn.Module]] | None = None
    #: float8: the recipe and how (``precision/float8.Float8``); None: the matmuls in the training dtype
    float8: Float8 | None = None
    tensor_parallel: TensorParallel | None = None
    expert_parallel: ExpertParallel | None = None
    #: None, "full", "selective" or k (every k-th block whole; ``parallel/memory/checkpointing.py``)
    activation_checkpointing: str | int | None = None
    #: checkpoint activations for models with their own mechanism (Hugging Face ``gradient_checkpointing_enable``),
    #: given the module and the mode
    own_checkpointing: Callable[[nn.Module, str | int], bool] | None = None
    compile: bool = False
    compile_kwargs: dict[str, Any] = field(default_factory=dict)
    #: "blocks": each block compiled in place; "model": each stage whole, and the model's loss
    compile_scope: str = "blocks"
    fully_shard: FullyShard | None = None
    #: quantize base: "nf4" stores each LoRA layer's frozen weight in torchao's NF4 (QLoRA) as it is materialised
    quantize_base: str | None = None


def _blocks_in(module: nn.Module, root: nn.Module, blocks: Sequence[str]) -> list[str]:
    """The plan's blocks (paths in ``root``) that lie in ``module``, as paths relative to ``module``."""
    if module is root:
        return [b for b in blocks if _exists(root, b)]
    where = {id(m): p for p, m in module.named_modules()}
    return [where[id(root.get_submodule(b))] for b in blocks if _exists(root, b) and id(root.get_submodule(b)) in where]


def _exists(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
        return True
    except AttributeError:
        return False


def compile_model(stage: nn.Module, model: nn.Module, kwargs: dict[str, Any]) -> None:
    """The stage compiled whole in place (the model's forward, one graph between FSDP's hooks, which
    Dynamo leaves out of its graphs), and, once for the model, its ``loss_fn``: the logits' upcast,
    log-softmax and gathering fused into one kernel. A chunked loss (``chunked_loss.py``) stays eager: it is a
    loop of checkpointed chunks Dynamo would unroll, with a tensor-parallel collective inside."""
    stage.compile(**kwargs)
    loss = loss_fn_of(model)
    if loss is not None and chunked_head(model) is None and not getattr(model, "_compiled_loss", False):
        model.loss_fn = torch.compile(loss, **kwargs)
        model._compiled_loss = True


def parallelize(module: nn.Module, spec: Techniques) -> list[nn.Module]:
    """Apply ``spec`` to ``module`` in the order of techniques (the module docstring); returns the
    stage modules of this rank (``[module]`` without a pipeline)."""
    plan = spec.plan.plan
    deferred = has_meta_tensors(module)
    # build on meta (done by the strategy): remember how to initialise what was built
    templates = capture_templates(module, init_groups(module, plan.blocks)) if deferred else None
    refs = tensor_refs(module) if deferred and spec.init_trace is not None else None
    weights = weight_sources(module) if deferred else None  # pretrained checkpoints, opened before any technique
    if not deferred:
        module.to(spec.device)

    tiling = with_tied_partners(module, spec.tiling) if spec.tiling else {}               # tile
    if spec.tensor_parallel is not None:  # the tied partner tiled with a named layer must not be split either
        check_tiling(tiling, plan.tp_plan)
    tiles = apply_tiling(module, tiling) if tiling else []
    stages = spec.cut(module) if spec.cut is not None else [module]                      # cut stages
    heads = output_layers(plan.tp_plan)
    for stage in stages:
        if spec.float8 is not None:                                                      # float8
            apply_float8(stage, spec.float8, heads=heads)
        if spec.tensor_parallel is not None:                                             # tensor parallel
            tp = spec.tensor_parallel
            # a pipeline stage registers its layers under their full paths: the plan's patterns fit as they are
            # experts stay plain for expert parallelism to shard over ep (every tp rank runs them whole)
            experts = _blocks_in(stage, module, spec.expert_parallel.experts) if spec.expert_parallel else []
            apply_tensor_parallel(stage, tp_mesh=tp.mesh, plan=plan.tp_plan,
                                  sequence_parallel=tp.sequence_parallel, loss_parallel=tp.loss_parallel,
                                  divisible=plan.tp_divisible, strict=spec.cut is None, keep_plain=experts)
        if spec.expert_parallel is not None:                                             # expert parallel
            ep = spec.expert_parallel
            expert_modules = apply_expert_parallel(stage, ep_mesh=ep.mesh, experts=_blocks_in(stage, module, ep.experts),
                                                   install=plan.install_experts)
        blocks = _blocks_in(stage, module, plan.blocks)
        stage_tiles = _blocks_in(stage, module, tiles)
        held: list[str] = []
        if spec.activation_checkpointing:                                                # checkpoint activations
            mode = spec.activation_checkpointing
            held = _blocks_in(stage, module, every_kth(plan.blocks, mode))
            if spec.own_checkpointing is None or not spec.own_checkpointing(stage, mode):
                apply_activation_checkpointing(stage, blocks=held, mode="full" if isinstance(mode, int) else mode)
        # tiles: always checkpointed (their point is memory), unless a checkpointed block already holds them
        apply_activation_checkpointing(stage, blocks=[t for t in stage_tiles
                                                      if not any(t.startswith(b + ".") for b in held)])
        if spec.compile and spec.compile_scope == "model":                               # compile
            compile_model(stage, module, spec.compile_kwargs)
        elif spec.compile:
            for path in blocks:
                stage.get_submodule(path).compile(**spec.compile_kwargs)
        if spec.quantize_base == "nf4":                                                  # quantize base
            if spec.fully_shard is not None:
                check_nf4_split(stage, spec.fully_shard.mesh.size(spec.fully_shard.mesh.ndim - 1))
            quantize_bases(stage)  # on meta: NF4 weights for FSDP to split; materialise fills them
        if spec.fully_shard is not None:                                                 # fully shard
            fs = spec.fully_shard
            ignored = None
            if spec.expert_parallel is not None and spec.expert_parallel.fsdp_mesh is not None:
                ep = spec.expert_parallel
                shard_experts(expert_modules, mesh=ep.fsdp_mesh, reshard_after_forward=fs.reshard_after_forward,
                              param_dtype=fs.param_dtype, reduce_dtype=fs.reduce_dtype)
            elif spec.expert_parallel is not None:  # no data axis beside ep: experts stay ep shards, outside FSDP
                ignored = {p for mod in expert_modules for p in mod.parameters()}
            units = blocks if fs.units is None else resolve_units(stage, fs.units if isinstance(fs.units, (str, int))
                                                                  else list(fs.units))
            if stage_tiles:  # each tile a unit of its own (nested units are sharded first), in model order
                # by identity: checkpoint activations' wrappers renamed the modules below a wrapped block
                order = {id(m): i for i, m in enumerate(stage.modules())}
                units = sorted({*units, *stage_tiles}, key=lambda path: order[id(stage.get_submodule(path))])
            # a chunked output layer's weight is read by the loss after the model's forward (the training step's
            # loss, a pipeline's after its last stage): the root keeps its parameters gathered from forward to
            # backward (FSDP2's own default for a root)
            head = chunked_head(stage)
            apply_fsdp(stage, mesh=fs.mesh, units=units, reshard_after_forward=fs.reshard_after_forward,
                       param_dtype=fs.param_dtype, reduce_dtype=fs.reduce_dtype, cpu_offload=fs.cpu_offload,
                       prefetch=fs.prefetch, ignored_params=ignored, pin_memory=fs.disk_tier is None, in_root=head,
                       root_reshard_after_forward=False if head is not None else None)
    tier = spec.fully_shard.disk_tier if spec.fully_shard is not None else None
    if templates is not None:                                                            # materialise
        offload = spec.fully_shard is not None and spec.fully_shard.cpu_offload
        # an NF4 weight (quantize base) is filled whole-weight-quantized, then cut (adapters/lora.fill_nf4)
        n = materialize(module, device=spec.device, templates=templates, seed=spec.seed, init_fn=spec.init_fn,
                        param_device=torch.device("cpu") if offload else None, trace=spec.init_trace, refs=refs,
                        weights=weights, home=tier.home_parameters if tier is not None else None,
                        after_group=(lambda path: tier.release()) if tier is not None else None)
        log.info("materialised %d local tensors on %s from %d init groups", n, spec.device, len(templates))
    elif tier is not None:  # a model built with real tensors: its shards are copied into the files
        tier.home_parameters(module, copy=True)
    if tier is not None:
        tier.attach(module)
    return stages

