"""ZeRO stages 1, 2 and 3 (Rajbhandari et al. 2020) as Lightning strategies.

With Ψ parameters on N data-parallel ranks, each stage shards one more kind of model state:

- ``zero1``: optimizer state (P_os). DDP averages full gradients; torch's ``ZeroRedundancyOptimizer``
  gives each rank whole parameters to own (greedy by size), it updates those and broadcasts them.
- ``zero2``: also gradients (P_os+g). No DDP: ``Zero2Optimizer`` (layer 1) reduce-scatters the local
  gradients in buckets from backward hooks into a 1/N shard per rank (full gradients never exist at
  once), steps its shard and all-gathers the parameters.
- ``zero3``: also parameters (P_os+g+p) -- FSDP with the model plan's blocks as units, parameters
  freed after forward (``FSDPStrategy`` with those settings fixed).
- ``zero3_offload``: zero3 with parameters, gradients and optimizer state in host memory and the
  optimizer step on the host (ZeRO-Offload / ZeRO-Infinity's CPU tier).

Offload exists only where it is real: zero1 and zero2 take no offload option.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from lightning_par.parallel.sharding.disk_offload import FileTier, PagedOptimizer, check_offload_dir, disk_bytes_needed
from lightning_par.parallel.layout import CostOptions
from lightning_par.parallel.mesh import ParallelDims
from lightning_par.parallel.sharding.zero import COLLECTIVES, Zero2Optimizer, make_zero1_optimizer
from lightning_par.strategies.base import ShardedStrategy
from lightning_par.strategies.checkpoint.dcp import canonical_fqn, hyperparameters, initialize_optimizer_state, module_fqns
from lightning_par.strategies.ddp import DDPStrategy
from lightning_par.strategies.fsdp import FSDPStrategy
from lightning_par.core.units import fmt_bytes


class Zero1Strategy(DDPStrategy):
    """ZeRO stage 1: DDP gradients + optimizer state sharded by ``ZeroRedundancyOptimizer``.

    Takes DDP's arguments (gradient buckets, static graph, SyncBatchNorm, activation checkpointing).
    Clipping needs nothing special: DDP has already averaged the gradients when Lightning clips.
    """

    strategy_name = "lp_zero1"

    def dims_for(self, world_size: int) -> ParallelDims:
        return ParallelDims(dp_shard=world_size)

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        for i, opt in enumerate(list(self.optimizers)):
            self._replace_optimizer(i, make_zero1_optimizer(opt))

    # checkpoints: each rank writes / reads the canonical state of the parameters it owns
    def checkpoint_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        assert isinstance(optimizer, ZeroRedundancyOptimizer)
        fqns = module_fqns(self.lightning_module)
        state = {fqns[p]: dict(s) for p, s in optimizer.optim.state.items()}
        groups = [{**hyperparameters(g), "params": [fqns[p] for p in g["params"]]} for g in optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def optimizer_state_template(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        assert isinstance(optimizer, ZeroRedundancyOptimizer)
        initialize_optimizer_state(optimizer, optimizer.optim.state)
        return self.checkpoint_optimizer_state(optimizer)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        assert isinstance(optimizer, ZeroRedundancyOptimizer)
        fqns = module_fqns(self.lightning_module)
        for p in optimizer.optim.state:  # the template's tensors (loaded in place by DCP) are the live ones
            optimizer.optim.state[p] = dict(state["state"][fqns[p]])
        for group, saved in zip(optimizer.param_groups, state["param_groups"]):
            group.update(hyperparameters(saved))  # synced to the local optimizer at every step


class Zero2Strategy(ShardedStrategy):
    """ZeRO stage 2: optimizer state and gradients sharded (``Zero2Optimizer``), no DDP wrapper.

    ``trainer.gradient_clip_val`` clips by the global norm of the *reduced* gradient inside the
    optimizer step; Lightning's own clipping (before the reduction, on local gradients) is skipped.
    Only norm clipping exists.

    Args:
        activation_checkpointing: true or "full" recomputes each block in backward, "selective" keeps matmuls,
            k (an int) recomputes every k-th block.
        process_group_backend: None picks gloo on CPU and NCCL on CUDA.
        sync_batchnorm: BatchNorm statistics over all ranks (as ``Trainer(sync_batchnorm=True)``).
        bucket_cap_mb: gradients reduce-scattered together from backward (MB of parameters per bucket).
        collectives: ``reduce_scatter`` (+ all-gather of the parameters), ``all_reduce`` (+ broadcasts:
            the same payload, faster on gloo) or ``auto``: ``all_reduce`` on gloo, else ``reduce_scatter``.
    """

    strategy_name = "lp_zero2"

    def __init__(self, activation_checkpointing: bool | str = False, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, sync_batchnorm: bool = False,
                 bucket_cap_mb: float = 25.0, collectives: str = "auto") -> None:
        super().__init__(activation_checkpointing=activation_checkpointing,
                         process_group_backend=process_group_backend, timeout=timeout, sync_batchnorm=sync_batchnorm)
        if collectives not in ("auto", *COLLECTIVES):
            raise ValueError(f"{self.strategy_name}: collectives must be one of auto, {', '.join(COLLECTIVES)}; "
                             f"got {collectives!r}")
        self.bucket_cap_mb = bucket_cap_mb
        self.collectives = collectives

    def cost_options(self) -> CostOptions:
        return replace(super().cost_options(), zero2_collectives=self.zero2_collectives)

    @property
    def zero2_collectives(self) -> str:
        """The collectives the optimizer runs: ``collectives``, ``auto`` resolved by the process group's backend."""
        if self.collectives != "auto":
            return self.collectives
        backend = self.process_group_backend
        if backend is None:  # before launch (the estimator asks) there are no devices yet: the default GPU's
            devices = self.parallel_devices
            cuda = devices[0].type == "cuda" if devices else torch.cuda.is_available()
            backend = "nccl" if cuda else "gloo"
        return "all_reduce" if backend == "gloo" else "reduce_scatter"

    def validate_setup(self, world_size: int, module: nn.Module) -> None:
        super().validate_setup(world_size, module)
        kinds = {(p.dtype, p.device.type) for p in module.parameters() if p.requires_grad}
        if len(kinds) > 1:
            raise ValueError(f"{self.strategy_name}: zero2 flattens all parameters into one buffer, but "
                             f"{type(module).__name__} mixes {sorted(str(d) for d, _ in kinds)}; use strategy=zero3 "
                             "or fsdp")

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        clip = trainer.gradient_clip_val
        if clip and trainer.gradient_clip_algorithm not in (None, "norm"):  # None: Lightning's default, norm
            raise ValueError(f"{self.strategy_name}: zero2 clips by the global norm only; use "
                             "trainer.gradient_clip_algorithm=norm")
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(f"{self.strategy_name}: zero2 frees each parameter's .grad into its reduce-scatter "
                             "bucket, where fp16's loss scaler cannot unscale it; use trainer.precision=bf16-mixed, "
                             "or strategy=zero1 / zero3")
        group = self.device_mesh.get_group("dp_shard")
        for i, opt in enumerate(list(self.optimizers)):
            self._replace_optimizer(i, Zero2Optimizer(opt, self.lightning_module, process_group=group,
                                                      max_grad_norm=float(clip) if clip else None,
                                                      bucket_cap_mb=self.bucket_cap_mb,
                                                      collectives=self.zero2_collectives, name=self.strategy_name))
        _skip_lightning_clipping(self.precision_plugin)

    def teardown(self) -> None:
        for opt in self.optimizers:
            inner = opt._optimizer if isinstance(opt, LightningOptimizer) else opt
            if isinstance(inner, Zero2Optimizer):
                inner.remove_hooks()
        super().teardown()

    def model_state_tensors(self) -> dict[str, Any]:
        """Full parameters (the flat buffer, and the frozen parameters outside it: a LoRA model's base), the
        reduced gradient shard (the buckets staged during backward are transient), the sharded optimizer state."""
        zeros = [o for o in self.optimizers if isinstance(o, Zero2Optimizer)]
        params = [*(z.flat for z in zeros), *(p for p in self.lightning_module.parameters() if not p.requires_grad)]
        grads = [z.grad_shard for z in zeros]
        states = [t for z in zeros for s in z.inner.state.values() for t in s.values() if torch.is_tensor(t)]
        return {"params": iter(params), "grads": iter(grads), "optimizer_state": iter(states)}

    # checkpoints: the flat shard converted to / from the canonical per-parameter layout
    def checkpoint_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        assert isinstance(optimizer, Zero2Optimizer)
        return _rename(optimizer.full_state_dict(), canonical_fqn)

    def optimizer_state_template(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        assert isinstance(optimizer, Zero2Optimizer)
        optimizer.initialize_state()
        return self.checkpoint_optimizer_state(optimizer)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        assert isinstance(optimizer, Zero2Optimizer)
        raw = {canonical_fqn(n): n for n, _ in self.lightning_module.named_parameters()}
        optimizer.load_full_state_dict(_rename(state, raw.__getitem__))


def _rename(state: dict[str, Any], fn: Any) -> dict[str, Any]:
    return {"state": {fn(k): v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [fn(p) for p in g["params"]]} for g in state["param_groups"]]}


def _skip_lightning_clipping(precision_plugin: Any) -> None:
    """Make the precision plugin's gradient clipping a no-op for ``Zero2Optimizer`` (which clips
    after its reduce-scatter); other optimizers are clipped as before."""
    original = precision_plugin.clip_gradients
    if getattr(original, "_lp_zero2", False):
        return

    def clip_gradients(optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None) -> None:
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(inner, Zero2Optimizer):
            return None
        return original(optimizer, clip_val, gradient_clip_algorithm)

    clip_gradients._lp_zero2 = True  # type: ignore[attr-defined]
    precision_plugin.clip_gradients = clip_gradients


def _paged_clipping(precision_plugin: Any) -> None:
    """Route Lightning's gradient clipping (``trainer.gradient_clip_val``) of a ``PagedOptimizer`` to
    its chunked clipping: torch's functions read every gradient page of the disk tier's files at once."""
    if getattr(precision_plugin.clip_grad_by_norm, "_lp_paged", False):
        return
    by_norm, by_value = precision_plugin.clip_grad_by_norm, precision_plugin.clip_grad_by_value

    def unwrap(optimizer: Any) -> Any:
        return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

    def clip_grad_by_norm(optimizer: Any, clip_val: Any) -> None:
        inner = unwrap(optimizer)
        return inner.clip_grad_norm_(clip_val) if isinstance(inner, PagedOptimizer) else by_norm(optimizer, clip_val)

    def clip_grad_by_value(optimizer: Any, clip_val: Any) -> None:
        inner = unwrap(optimizer)
        return inner.clip_grad_value_(clip_val) if isinstance(inner, PagedOptimizer) else by_value(optimizer, clip_val)

    clip_grad_by_norm._lp_paged = True  # type: ignore[attr-defined]
    precision_plugin.clip_grad_by_norm = clip_grad_by_norm
    precision_plugin.clip_grad_by_value = clip_grad_by_value


class Zero3Strategy(FSDPStrategy):
    """ZeRO stage 3: FSDP with the model plan's blocks as units, parameters freed after forward,
    one unit of prefetch.

    Args:
        activation_checkpointing: true or "full" recomputes each block in backward, "selective" keeps matmuls,
            k (an int) recomputes every k-th block.
        param_dtype / reduce_dtype: FSDP mixed precision (``bf16``, ``fp16``, ``fp32`` or null): the
            sharded parameters stay in their dtype (the fp32 master copy), forward/backward compute
            in ``param_dtype``, gradients are reduced in ``reduce_dtype``. Or Lightning's
            ``trainer.precision`` (bf16-mixed: autocast over fp32 parameters).
        process_group_backend: None picks gloo on CPU and NCCL on CUDA.
        sync_batchnorm: BatchNorm statistics over all ranks (as ``Trainer(sync_batchnorm=True)``).
    """

    strategy_name = "lp_zero3"
    #: fixed, as the units, resharding and prefetch below (zero3_offload: True)
    cpu_offload = False

    def __init__(self, activation_checkpointing: bool | str = False, param_dtype: str | None = None,
                 reduce_dtype: str | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, sync_batchnorm: bool = False) -> None:
        super().__init__(units="blocks", reshard_after_forward=True, prefetch=1, cpu_offload=self.cpu_offload,
                         activation_checkpointing=activation_checkpointing, param_dtype=param_dtype,
                         reduce_dtype=reduce_dtype, process_group_backend=process_group_backend, timeout=timeout,
                         sync_batchnorm=sync_batchnorm)


class Zero3OffloadStrategy(Zero3Strategy):
    """ZeRO stage 3 with CPU offload: parameter shards, gradients and optimizer state live in host
    memory; each unit's parameters are copied to the device for its forward/backward, gradients are
    copied back, and the optimizer step runs on the host (FSDP2's ``CPUOffloadPolicy``).

    With ``offload_dir`` they live in files there instead (the disk tier, ZeRO-Infinity's NVMe tier:
    ``parallel/sharding/disk_offload.py``), host memory holding only the pages in use: a unit's shards while
    it is gathered, a parameter's gradient while FSDP accumulates it, a chunk of the optimizer step.

    Args:
        activation_checkpointing: true or "full" recomputes each block in backward, "selective" keeps matmuls,
            k (an int) recomputes every k-th block.
        process_group_backend: None picks gloo on CPU and NCCL on CUDA.
        offload_dir: directory for the disk tier's files (created if missing; needs room for this
            node's ranks' parameters, gradients and optimizer state); None keeps them in host memory.
        offload_chunk_mb: parameter bytes per chunk of the disk tier's paged optimizer step.
    """

    strategy_name = "lp_zero3_offload"
    cpu_offload = True

    def __init__(self, activation_checkpointing: bool | str = False, param_dtype: str | None = None,
                 reduce_dtype: str | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, sync_batchnorm: bool = False,
                 offload_dir: str | None = None, offload_chunk_mb: float = 64.0) -> None:
        super().__init__(activation_checkpointing=activation_checkpointing, param_dtype=param_dtype,
                         reduce_dtype=reduce_dtype, process_group_backend=process_group_backend, timeout=timeout,
                         sync_batchnorm=sync_batchnorm)
        self.offload_dir = str(offload_dir) if offload_dir not in (None, "") else None
        self.offload_chunk_mb = offload_chunk_mb
        self.disk_tier: FileTier | None = None


    def cost_options(self) -> CostOptions:
        return replace(super().cost_options(), disk_offload=self.offload_dir is not None)

    def disk_bytes_per_rank(self, module: nn.Module, world_size: int, state_per_param: int = 8) -> int:
        """The disk tier's files of one rank: fp32 shards of the parameters and gradients, and
        ``state_per_param`` bytes of optimizer state per parameter (AdamW's m and v: 8)."""
        n = sum(p.numel() for p in module.parameters())
        per_rank = -(-n // max(1, world_size))
        return disk_bytes_needed(4 * per_rank, 4 * per_rank, state_per_param * per_rank)

    def validate_setup(self, world_size: int, module: nn.Module) -> None:
        super().validate_setup(world_size, module)
        if self.offload_dir is not None:
            if not isinstance(self.offload_chunk_mb, (int, float)) or not self.offload_chunk_mb > 0:
                raise ValueError(f"strategy.offload_chunk_mb={self.offload_chunk_mb!r}: expected a number > 0")
            nodes = max(1, int(getattr(self, "num_nodes", 1) or 1))
            ranks_here = -(-world_size // nodes)
            per_rank = self.disk_bytes_per_rank(module, world_size)
            check_offload_dir(self.offload_dir, ranks_here * per_rank,
                              what=f"{ranks_here} rank{'s' if ranks_here > 1 else ''} x {fmt_bytes(per_rank)} of "
                                   "fp32 parameter and gradient shards and AdamW state")

    def techniques(self, module: nn.Module, resolved: Any) -> dict:
        out = super().techniques(module, resolved)
        if self.offload_dir is not None:
            directory = check_offload_dir(self.offload_dir)
            self.disk_tier = FileTier(directory, rank=self.global_rank, chunk_mb=self.offload_chunk_mb)
            out["fully_shard"] = replace(out["fully_shard"], disk_tier=self.disk_tier)
        return out

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        tier = self.disk_tier
        if tier is None:
            return
        tier.home_gradients()
        for i, opt in enumerate(list(self.optimizers)):
            self._replace_optimizer(i, PagedOptimizer(opt, tier))
        _paged_clipping(self.precision_plugin)

    # checkpoints: the template's state must exist (in the files) before DCP loads into it
    def optimizer_state_template(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, PagedOptimizer):
            optimizer.initialize_state()
        return super().optimizer_state_template(optimizer)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        meta = super().load_checkpoint(checkpoint_path, weights_only)
        if self.disk_tier is not None:
            self.disk_tier.check_parameters_homed()
            self.disk_tier.release()
        return meta

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.disk_tier is not None:
            self.disk_tier.release()  # DCP read every page of the files

    def teardown(self) -> None:
        for opt in self.optimizers:
            inner = opt._optimizer if isinstance(opt, LightningOptimizer) else opt
            if isinstance(inner, PagedOptimizer):
                inner.close()
        super().teardown()
        if self.disk_tier is not None:
            self.disk_tier.close()
            self.disk_tier = None
