"""What every lightning_par strategy shares, on top of Lightning's own strategy classes.

``ParStrategyMixin`` adds: the multirun-safe launcher (see ``launcher.py``), a ``ParallelDims``
description of the mesh (``mesh_sizes`` for the run summary), data-parallel sampler ranks taken
from the mesh's data-parallel axes, ``prepare_model`` (validation, then every technique through the
one ordered ``parallel/parallelize.py``, the model built on the meta device), and
``model_state_tensors`` -- the tensors this rank holds per category, which the memory callback
counts. Strategies stay thin: they decide the mesh and say which techniques (``techniques``).

``ShardedStrategy`` is the base of the strategies that shard model states without DDP's wrapper
(zero2, zero3, zero3_offload, fsdp/hsdp). It derives from Lightning's ``ModelParallelStrategy``,
Lightning's strategy for modules that parallelize themselves: it does not wrap the model, runs on
CPU (gloo) as on GPU, starts the process group, restores checkpoints after setup (into the sharded
model) and provides barrier/broadcast/reduce/all_gather. We replace its mesh (``ParallelDims``,
built in ``setup_environment``), its ``setup`` (``prepare_model`` instead of the module applying
parallelism in ``configure_model``), its launcher (multirun-safe) and its checkpoint format (strategy-neutral,
``checkpoint.py``).
"""

from __future__ import annotations

import atexit
import gc
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import lightning as L
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from lightning_par import ConfigError
from lightning_par.parallel.adapters.lora import check_nf4_available, is_nf4
from lightning_par.parallel.discovery import ResolvedPlan, checkpointing_fn_of, init_fn_of, resolve_plan
from lightning_par.parallel.hf.save import install_sharded_save
from lightning_par.parallel.init.init_trace import InitTrace
from lightning_par.parallel.layout import CostOptions
from lightning_par.parallel.contract import example_input_of
from lightning_par.parallel.init.materialize import canonical_name, has_meta_tensors
from lightning_par.parallel.mesh import ParallelDims, dp_coordinates
from lightning_par.parallel.parallelize import Techniques, parallelize
from lightning_par.parallel.hf.from_pretrained import transformers_from_pretrained_on_meta
from lightning_par.parallel.sharding.sync_batchnorm import convert_sync_batchnorm, revert_sync_batchnorm
from lightning_par.parallel.memory.checkpointing import checkpointed_blocks, checkpointing_mode
from lightning_par.parallel.memory.tiling import check_tiling
from lightning_par.parallel.precision.float8 import (Float8, convertible, device_refusal, float8_option, float8_weights,
                                                     missing_torchao, modified_in_place, output_layers)
from lightning_par.strategies.checkpoint.dcp import DistributedCheckpointMixin
from lightning_par.core.fork_ranks import ChildEntry

log = logging.getLogger(__name__)

# LightningModule methods that run the model: FSDP's root hooks must fire on them even when they
# call submodules directly instead of ``self(...)``
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` stored on this rank (a DTensor's local shard, else ``t`` itself)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _destroy_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # a group already destroyed (the app does it after each job) lives on while a model that is
    # garbage but not yet collected (a reference cycle) still points at it: collect now, so its
    # worker threads are joined before finalisation
    gc.collect()


def destroy_process_group_at_exit() -> None:
    """Call once the process group is up: destroy it when the interpreter exits.

    Lightning's teardown leaves the process group alive (a second ``fit`` reuses it), so a user's
    script reaches interpreter shutdown with gloo's worker threads still running. On torch 2.13 CPU
    a worker then frees a finished all-reduce whose thread-local state holds a Python object, tries
    to take the GIL during finalisation and aborts the process ("terminate called without an active
    exception", exit 134): 3 of 6 two-rank ``fit`` runs with Lightning's own ``ddp``. An ``atexit``
    handler runs while the interpreter is still whole; after it, 0 of 20.
    """
    atexit.unregister(_destroy_process_group)  # once per process, however many fits
    atexit.register(_destroy_process_group)


class GlobalSyncBatchNorm(LayerSync):
    """Lightning ``LayerSync`` plugin for lightning_par's device-agnostic synchronized BatchNorm
    (``parallel/sharding/sync_batchnorm.py``) over the group ``group_fn()`` returns (None: the default group),
    resolved when applied (the process group does not exist yet when the Trainer is built)."""

    def __init__(self, group_fn: Any = None) -> None:
        self.group_fn = group_fn

    def apply(self, model: nn.Module) -> nn.Module:
        return convert_sync_batchnorm(model, self.group_fn() if self.group_fn is not None else None)

    def revert(self, model: nn.Module) -> nn.Module:
        return revert_sync_batchnorm(model)


def has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


class ParStrategyMixin:
    """Mixed into a Lightning ``Strategy`` subclass (it must come first in the bases)."""

    #: set by run.py: how ranks 1..N-1 start, a ``fork_ranks.ChildEntry`` (forked) or a command (started);
    #: None: Lightning's re-run of the script
    child_command: ChildEntry | Sequence[str] | None = None
    child_cwd: str | None = None
    #: True when the strategy keeps model states in host memory (the memory callback reads it)
    cpu_offload: bool = False
    activation_checkpointing: bool | str = False
    #: ``torch.compile``: False; True or "blocks" (each repeated block in place); "model" (each stage whole,
    #: and the model's loss); or torch.compile's keyword arguments (``{"mode": "max-autotune-no-cudagraphs",
    #: "scope": "model"}``). The app sets it from the top-level ``compile`` key, a user's own Trainer by
    #: ``strategy.compile = True`` before ``fit``
    compile: bool | str | dict[str, Any] = False
    #: float8 training of the linear layers (``parallel/precision/float8.py``): None, "tensorwise" or "rowwise";
    #: the app sets it from ``model.float8``, a user's own Trainer by ``strategy.float8 = "rowwise"`` before ``fit``
    float8: str | None = None
    #: what setup learnt about the model (units rule, parameter count), for the run summary
    model_facts: dict[str, Any] = {}
    #: memory-centric tiling: module path -> tile count (``parallel/memory/tiling.py``); the app sets it from
    #: ``strategy.tiling``, a user's own Trainer by ``strategy.tiling = {...}`` before ``fit``
    tiling: dict[str, int] = {}
    #: BatchNorm statistics over the data-parallel ranks (the strategy's own option; ``Trainer(sync_batchnorm=True)``
    #: turns it on too, through Lightning's ``_layer_sync``)
    sync_batchnorm: bool = False

    # ------------------------------------------------------------------ synchronized BatchNorm
    # Lightning's trainer sets ``strategy._layer_sync`` from ``Trainer(sync_batchnorm=...)`` (torch's
    # SyncBatchNorm plugin, or None): it is kept as the trainer's wish, and the plugin returned is ours
    # (torch's refuses CPU modules, and only knows the whole world as its group), unless the trainer was
    # given some other ``LayerSync`` plugin, which is used as it is.
    @property
    def _layer_sync(self) -> LayerSync | None:
        given = self.__dict__.get("_trainer_layer_sync")
        if given is not None and not isinstance(given, TorchSyncBatchNorm):
            return given
        return self.layer_sync_plugin() if self.wants_sync_batchnorm() else None

    def wants_sync_batchnorm(self) -> bool:
        """The strategy's option or ``Trainer(sync_batchnorm=True)`` (answerable before launch: builds no plugin)."""
        return bool(getattr(self, "sync_batchnorm", False)) or self.__dict__.get("_trainer_layer_sync") is not None

    @_layer_sync.setter
    def _layer_sync(self, value: LayerSync | None) -> None:
        self.__dict__["_trainer_layer_sync"] = value

    def layer_sync_plugin(self) -> LayerSync:
        """The plugin that synchronizes BatchNorm under this strategy."""
        return GlobalSyncBatchNorm(self.sync_batchnorm_group)

    def sync_batchnorm_group(self) -> Any:
        """The process group of the data-parallel ranks, the ranks that read different samples (None:
        the default group, when every rank is one). Strategies with model-parallel axes override it."""
        dims = self.parallel_dims
        if dims.dp != dims.world_size:  # pragma: no cover - a strategy with pp/tp axes must override this
            raise NotImplementedError(f"{type(self).__name__}: no data-parallel group for sync_batchnorm")
        return None

    def check_sync_batchnorm(self, world_size: int, module: nn.Module) -> None:
        """Raise ``ValueError`` (one line) where synchronized BatchNorm cannot give ``module`` the
        statistics of the global batch under this strategy; nothing by default."""

    # ----------------------------------------------------------------------------- costs
    def cost_options(self) -> CostOptions:
        """What this strategy states about itself for the cost models (``parallel/layout.py``): the
        estimator and the comm prediction read this, never the strategy's attributes. Strategies with
        options of their own extend it (``replace(super().cost_options(), ...)``)."""
        return CostOptions(recompute=checkpointing_mode(self.activation_checkpointing) or False,
                           cpu_offload=bool(self.cpu_offload), float8=float8_option(self.float8))

    # ----------------------------------------------------------------------------- mesh
    def dims_for(self, world_size: int) -> ParallelDims:
        """The mesh this strategy builds for ``world_size`` processes (pure: no process group needed)."""
        return ParallelDims(dp_replicate=world_size)

    def validate_setup(self, world_size: int, module: nn.Module) -> None:
        """Raise ``ValueError`` (one line) if this strategy cannot run ``module`` on ``world_size`` ranks.

        Called before any process starts by the lightning_par app, and again at the start of
        ``setup`` (before any collective) for a strategy used from a user's own ``Trainer``.
        """
        self.dims_for(world_size).validate(world_size)
        if self.wants_sync_batchnorm():
            self.check_sync_batchnorm(world_size, module)
        mode = checkpointing_mode(self.activation_checkpointing)  # false, true, full or selective, else one line
        if mode == "selective" and getattr(self, "tiling", None):
            # a tile is its own FSDP unit and checkpoint inside the block: torch's selective checkpointing of the
            # block then meets the tile's hooks in backward in another order than in forward, and fails
            blocks = resolve_plan(module).plan.blocks
            inside = sorted(t for t in self.tiling if any(t.startswith(b + ".") for b in blocks))
            if inside:
                raise ValueError(f"activation_checkpointing=selective cannot checkpoint a block whose layers are tiled "
                                 f"(strategy.tiling: {inside[0]}, ...): use activation_checkpointing=true")
        self.check_float8(module, world_size)
        self.check_lora(module, world_size)
        if self.activation_checkpointing and not resolve_plan(module).plan.blocks:
            raise ValueError(f"{type(self).__name__}: activation_checkpointing found no blocks in "
                             f"{type(module).__name__} (no declared plan, no repeated children, no large submodule)")

    def check_float8(self, module: nn.Module, world_size: int = 1) -> None:
        """The ``float8`` option against this layout and ``module`` (``ValueError``, one line)."""
        recipe = float8_option(self.float8)
        if recipe is None:
            return
        if missing_torchao():
            raise ValueError(missing_torchao())
        if not convertible(module, output_layers(resolve_plan(module).plan.tp_plan)):
            raise ValueError(f"float8={recipe}: no linear layer of {type(module).__name__} can compute in float8 "
                             "(both dimensions multiples of 16, not the output head): set float8=false")

    def float8_step(self, fully_shard: Any, module: nn.Module, paths: list[str]) -> Float8 | None:
        """``parallelize``'s float8 step on this rank's device: emulated off CUDA; tensorwise weights all-gathered
        in float8 under FSDP (not with CPU offload, whose shards torchao's all-gather does not handle); the
        layers ``paths`` whose output the model changes in place found by one forward on the meta device (a
        model built with real tensors is not probed)."""
        recipe = float8_option(self.float8)
        if recipe is None:
            return None
        refusal = device_refusal(self.root_device)
        if refusal:
            raise ConfigError(refusal)
        gather = recipe == "tensorwise" and fully_shard is not None and not fully_shard.cpu_offload
        example = example_input_of(module)
        own: tuple[str, ...] = ()
        if example is not None and has_meta_tensors(module):
            try:
                own = modified_in_place(module, lambda: module(example(1, "meta")), paths)
            except Exception as e:  # noqa: BLE001 -- a forward that cannot run on meta: nothing found, said why
                log.warning("float8: the meta-device forward that finds outputs changed in place failed (%s: %s); "
                            "a layer whose output the model changes in place will fail at its first step",
                            type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return Float8(recipe, emulate=self.root_device.type != "cuda", fsdp_all_gather=gather, own_output=own)

    @property
    def parallel_dims(self) -> ParallelDims:
        return self.dims_for(max(1, getattr(self, "world_size", 1)))

    @property
    def mesh_sizes(self) -> dict[str, int]:
        return self.parallel_dims.sizes()

    def teardown(self) -> None:
        """Lightning's teardown, except that a model still on the meta device -- a failure before it was
        materialised (a callback's or the model's ``setup``) -- is not moved to the CPU: that move fails
        ("Cannot copy out of meta tensor"), and its error would replace the run's own in error.json."""
        module = self.lightning_module
        if module is None or not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            return super().teardown()
        self._lightning_module = None
        try:
            super().teardown()
        finally:
            self._lightning_module = module

    # ------------------------------------------------------------------------- launcher
    def _make_launcher(self) -> _SubprocessScriptLauncher:
        from lightning_par.strategies.launcher import ChildCommandLauncher

        from lightning.pytorch.accelerators import CPUAccelerator

        return ChildCommandLauncher(self.cluster_environment, self.num_processes, self.num_nodes,
                                    child_command=self.child_command, child_cwd=self.child_cwd,
                                    fork_script=isinstance(self.accelerator, CPUAccelerator))

    # ---------------------------------------------------------------------- the model
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """Where ``configure_model()`` (and ``trainer.init_module()``) build the model: on the meta
        device unless ``empty_init=False``. ``setup`` applies the techniques to the meta model and
        then materialises only this rank's part with the model's own initialisation."""
        if empty_init is False:
            with self.precision_plugin.tensor_init_context():
                yield
            return
        # record what the constructor does to the meta tensors: materialisation replays it for the
        # tensors that no init function sets (a cls token, a constant buffer), see parallel/init/init_trace.py
        trace = getattr(self, "_init_trace", None) or InitTrace()
        # transformers' own from_pretrained(DIR) builds on meta too, marked for each rank to read its shards
        with torch.device("meta"), self.precision_plugin.tensor_init_context(), trace.recording(), \
                transformers_from_pretrained_on_meta():
            yield
        self._init_trace = trace

    def techniques(self, module: nn.Module, resolved: ResolvedPlan) -> dict[str, Any]:
        """This strategy's steps of ``parallelize`` beyond checkpointing and compile (``Techniques``
        fields: ``cut``, ``tensor_parallel``, ``fully_shard``); none by default."""
        return {}

    def check_lora(self, module: nn.Module, world_size: int) -> None:
        """``model.lora`` with what this strategy and its options can run, else one line: QLoRA's NF4 base is
        split by FSDP (rows and quantized blocks alike) but not by tensor parallelism, nor offloaded to the host;
        LoRA is not combined with float8."""
        lora = getattr(module, "lora", None)
        if lora is None:
            return
        if float8_option(self.float8):
            raise ValueError("model.lora with model.float8: float8 would replace the adapted layers; turn one off")
        if lora.base != "nf4":
            return
        check_nf4_available()
        split = [k for k in self.weight_splits(world_size) if k != "fully_shard"]
        if split or getattr(self, "cpu_offload", False):
            why = " and ".join(split) if split else "host offload"
            raise ValueError(f"model.lora.base=nf4 (QLoRA) runs on single, ddp, zero1, zero2, zero3, fsdp, hsdp and "
                             f"pipeline; {self.strategy_name} applies {why}, which NF4 weights do not take here yet")

    def weight_splits(self, world_size: int) -> list[str]:
        """The techniques by which this strategy splits a weight over ranks at ``world_size`` (``fully_shard``,
        ``tensor_parallel``), asked before launch; none by default."""
        return []

    def prepare_model(self, module: nn.Module) -> list[nn.Module]:
        """Check the model, then apply every technique in ``parallelize``'s one order (the first thing
        ``setup`` does; Lightning's DDP wrapping and the optimizers come after). Returns this rank's
        stage modules (``[module]`` without a pipeline)."""
        try:
            self.validate_setup(getattr(self, "world_size", 1), module)
        except ValueError as e:  # a user's own Trainer: the same one line as the app's pre-launch check
            raise ConfigError(str(e)) from None
        resolved = resolve_plan(module)
        # the whole model's parameters in order, before a pipeline cut leaves this rank only its stages':
        # what a Lightning file's position-keyed optimizer state is keyed by (lightning_file._by_name)
        self.full_parameter_names = [canonical_name(n) for n, _ in module.named_parameters()]
        self.model_facts = {"n_params": sum(p.numel() for p in module.parameters()), "units_rule": resolved.units_rule,
                            "plan_source": resolved.source}
        if self.compile:
            # a fresh Dynamo cache per model: in a sweep's later job (same process) graphs compiled for the
            # previous job's layout were reused for a tensor-parallel one and failed on its local shapes
            torch._dynamo.reset()
        seed = int(self.broadcast(torch.initial_seed() % (1 << 31)))  # one seed: the same weights on every rank
        trace, self._init_trace = getattr(self, "_init_trace", None), None  # used once, then released
        steps = self.techniques(module, resolved)
        # the whole model's float8 layers (a pipeline cut leaves this rank only its own): for the comm model
        whole = {p: module.get_submodule(p).weight.numel() for p in convertible(module, output_layers(resolved.plan.tp_plan))} \
            if float8_option(self.float8) else {}
        spec = Techniques(device=self.root_device, plan=resolved, seed=seed, init_fn=init_fn_of(module),
                          init_trace=trace, activation_checkpointing=checkpointing_mode(self.activation_checkpointing),
                          own_checkpointing=checkpointing_fn_of(module), **compile_fields(self.compile),
                          float8=self.float8_step(steps.get("fully_shard"), module, list(whole)),
                          quantize_base=lora.base if (lora := getattr(module, "lora", None)) is not None else None,
                          **steps)
        tp_plan = resolved.plan.tp_plan if spec.tensor_parallel is not None else None
        stages = parallelize(module, replace(spec, tiling=check_tiling(self.tiling, tp_plan)))
        if spec.quantize_base:  # QLoRA: the 4-bit base is frozen and already the same on every rank; DDP's start-up
            # broadcast of it (through NF4's own ops) moved the step-0 loss by 5e-5: DDP leaves it alone
            module._ddp_params_and_buffers_to_ignore = [n for n, p in module.named_parameters() if is_nf4(p)]
        # a Hugging Face model now sharded (DTensors) or cut: transformers' save_pretrained would fail or write
        # a part, so it becomes a collective that streams the whole model out (every rank calls it)
        install_sharded_save(module)
        # what compile did, for the run summary: modules whose call runs through torch.compile
        # (a pipeline's stage modules may be wrappers outside the model's own tree)
        reached = {id(m): m for root in (module, *stages) for m in root.modules()}
        self.model_facts["compiled_modules"] = sum(getattr(m, "_compiled_call_impl", None) is not None
                                                   for m in reached.values())
        self.model_facts["compile_scope"] = spec.compile_scope if spec.compile else None
        if spec.float8 is not None:  # what float8 converted on this rank's stages, for the run summary
            self.model_facts["float8"] = {"recipe": spec.float8.recipe, "emulated": spec.float8.emulate,
                                          "fsdp_float8_all_gather": spec.float8.fsdp_all_gather,
                                          "layers": len(whole), "params": sum(whole.values()),
                                          "layers_on_rank": sum(len(float8_weights(stage)) for stage in stages)}
        # what activation checkpointing was applied on this rank's stages, by mode
        checkpointed: dict[str, int] = {}
        for stage in stages:
            for mode, n in checkpointed_blocks(stage).items():
                checkpointed[mode] = checkpointed.get(mode, 0) + n
        self.model_facts["checkpointed_blocks"] = checkpointed
        if isinstance(module, FSDPModule):
            for name in _STEP_METHODS:
                if callable(getattr(module, name, None)):
                    register_fsdp_forward_method(module, name)
        return stages

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step, then the gradients freed at once (``free_gradients_after_step``)."""
        out = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        free_gradients_after_step(self.lightning_module, optimizer)
        return out

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


def free_gradients_after_step(module: Any, optimizer: Any) -> None:
    """Zero (set to None) the gradients right after the optimizer step, as a plain loop does.

    Lightning's automatic optimization zeroes them later, inside the next step's closure, *after* that
    step's ``training_step``: the previous step's gradients (4 bytes a parameter in fp32) stay alive
    through the whole next forward, and the forward's activation peak sits on top of them. On one H200,
    a 1.2B Llama peaked 2.65 GiB (6%) above a plain loop for that reason. Lightning's own call then
    finds nothing to free. Left to Lightning where the module zeroes gradients its own way (an
    ``optimizer_zero_grad`` override) or steps by hand (manual optimization)."""
    if module is None or not module.automatic_optimization:
        return
    if type(module).optimizer_zero_grad is not L.LightningModule.optimizer_zero_grad:
        return
    inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the torch one
    inner.zero_grad(set_to_none=True)


#: what ``compile`` compiles: each repeated block in place, or each stage whole and the loss
COMPILE_SCOPES = ("blocks", "model")


def compile_fields(option: bool | str | dict[str, Any] | None) -> dict[str, Any]:
    """``Techniques``' compile fields from the ``compile`` option: false, true (= blocks), ``blocks``,
    ``model``, or torch.compile's keyword arguments with an optional ``scope`` among them."""
    if option is None or option is False:
        return {"compile": False}
    if option is True:
        return {"compile": True}
    if isinstance(option, str) and option in COMPILE_SCOPES:
        return {"compile": True, "compile_scope": option}
    if isinstance(option, Mapping):
        kwargs = dict(option)
        scope = kwargs.pop("scope", "blocks")
        if scope in COMPILE_SCOPES:
            return {"compile": True, "compile_kwargs": kwargs, "compile_scope": scope}
    raise ConfigError(f"compile={option!r}: expected true, false, blocks, model or torch.compile's keyword arguments "
                      "(e.g. compile={mode:max-autotune-no-cudagraphs,scope:model})")


def _optimizer_states(opt: Any) -> Iterator[dict]:
    inner = getattr(opt, "optim", None)  # ZeroRedundancyOptimizer keeps the local optimizer in .optim
    source = inner if isinstance(inner, torch.optim.Optimizer) else opt
    yield from source.state.values()


class ShardedStrategy(ParStrategyMixin, DistributedCheckpointMixin, ModelParallelStrategy):
    """Base of the data-parallel strategies that shard model states without a DDP wrapper.

    Subclasses decide the mesh (``dims_for``), the techniques (``techniques``) and/or replace the
    optimizer (``setup_optimizers``). Setup order: precision conversion (on the meta model), then
    ``prepare_model`` (parallelize's order, ending with materialisation), then the optimizers.

    Args:
        activation_checkpointing: true or "full" recomputes each block in backward, "selective" keeps matmuls,
            k (an int) recomputes every k-th block.
        process_group_backend: None picks gloo on CPU and NCCL on CUDA.
        timeout: collective timeout (Lightning's default: 30 minutes).
        sync_batchnorm: BatchNorm statistics over the data-parallel ranks (as ``Trainer(sync_batchnorm=True)``).
    """

    def __init__(self, activation_checkpointing: bool | str = False, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, sync_batchnorm: bool = False) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self.activation_checkpointing = activation_checkpointing
        self.sync_batchnorm = sync_batchnorm

    def dims_for(self, world_size: int) -> ParallelDims:
        return ParallelDims(dp_shard=world_size)

    def _configure_launcher(self) -> None:
        self._launcher = self._make_launcher()

    def setup_environment(self) -> None:
        self._setup_distributed()  # device, global ranks, process group (Lightning's)
        destroy_process_group_at_exit()
        try:
            dims = self.dims_for(self.world_size)
            dims.validate(self.world_size)
        except ValueError as e:  # before any collective: the same one line on every rank
            raise ConfigError(str(e)) from None
        self._device_mesh = dims.build_mesh(self.root_device.type)
        self.lightning_module._device_mesh = self._device_mesh  # LightningModule.device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        rank, size = dp_coordinates(self._device_mesh, self.dims_for(self.world_size))
        return {"num_replicas": size, "rank": rank}

    def apply_layer_sync(self, trainer: Any) -> None:
        """``Trainer(sync_batchnorm=True)`` (or the strategy's option) when fitting: BatchNorm layers become
        synchronized over the data-parallel group -- on the model as built (the meta model), before any
        technique shards it, so FSDP shards the synchronized layers. Lightning's ``ModelParallelStrategy``
        ignores ``_layer_sync``; its ``DDPStrategy`` applies it in ``setup`` as here."""
        plugin = self._layer_sync
        if plugin is None or trainer.state.fn != TrainerFn.FITTING:
            return
        try:
            self.check_sync_batchnorm(self.world_size, self.lightning_module)
        except ValueError as e:  # before any collective: the same one line on every rank
            raise ConfigError(str(e)) from None
        if self.parallel_dims.dp > 1:  # one data-parallel rank: its batch statistics are the batch's already
            self.model = plugin.apply(self.model)

    def setup(self, trainer: Any) -> None:
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.apply_layer_sync(trainer)
        self.prepare_model(self.lightning_module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
