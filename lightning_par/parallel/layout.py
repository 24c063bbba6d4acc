"""What one rank holds under a strategy on a mesh, as the cost models read it, beside the mesh's dims.

- ``Sharding``: what a strategy splits over its data-parallel ranks (the ZeRO paper's stages);
- ``Layout``: one rank's share on a mesh -- the cost models' input (``costs/peak.py``, ``costs/comm.py``);
- ``CostOptions``: what a *built* strategy states about itself beyond its catalogue entry and its mesh
  (FSDP's mixed precision and prefetch, a pipeline's schedule and micro-batches, offload, ...). Every
  lightning_par strategy answers ``cost_options()`` (``strategies/base.py`` and the classes with
  options of their own), so the estimator and the comm prediction read one typed object instead of
  probing the strategy's attributes.

Plain dataclasses: no torch, no Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: how a strategy holds gradients during backward (costs/peak.py): summed in place, in DDP's
#: buckets, ZeRO-2's bucketed reduce-scatters into its shard, or FSDP's per-unit reduce-scatter
GRAD_MODES = ("accumulate", "bucket", "zero2", "fsdp")


@dataclass(frozen=True)
class Sharding:
    """What a strategy splits over its data-parallel ranks (the ZeRO paper's stages)."""

    params: bool = False
    optimizer: bool = False
    grads: str = "accumulate"  # one of GRAD_MODES
    cpu_offload: bool = False  # model states in host memory

    def __post_init__(self) -> None:
        if self.grads not in GRAD_MODES:
            raise ValueError(f"Sharding.grads must be one of {', '.join(GRAD_MODES)}, got {self.grads!r}")


@dataclass(frozen=True)
class Layout:
    """What one rank holds under a strategy on a mesh: the cost models' input (``costs/peak.py``,
    ``costs/comm.py``). Built by the catalogue entry's ``cost_layout`` (``strategies/catalog.py``) from the
    mesh and the strategy's own ``CostOptions``."""

    strategy: str
    shard: int = 1  # ranks the sharded states are split over
    params_sharded: bool = False
    opt_sharded: bool = False
    grads: str = "accumulate"
    cpu_offload: bool = False
    #: the offloaded states in files (zero3_offload's ``offload_dir``): host memory holds the step's chunks
    disk_offload: bool = False
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism: each rank holds 1/ep of every MoE layer's routed experts
    expert_shard: int | None = None  # ranks the experts' own states are sharded over (None: ``shard``)
    sequence_parallel: bool = False
    loss_parallel: bool = False
    schedule: str = "1f1b"
    n_microbatches: int | None = None
    virtual_stages: int = 1
    prefetch: int = 1
    gather_bytes: float | None = None  # bytes per gathered parameter element (None: the params' own)
    #: FSDP gathers the blocks' linear weights in float8 (``model.float8=tensorwise``): 1 byte per element
    float8_gather: bool = False
    tiling: dict[str, int] = field(default_factory=dict)
    mesh: dict[str, int] = field(default_factory=dict)
    data_parallel: str = "replicate"  # expert_parallel / 3d: how the data axis holds the non-expert states
    unsharded_grads: bool = False  # FSDP grad_sync=last_micro_batch with accumulation: full gradients held
    reshard_after_forward: bool = True  # FSDP frees every gathered unit, the root's too, after forward
    bucket_bytes: int = 25 * 2**20  # ZeRO-2's gradient buckets (the strategy's bucket_cap_mb default)


@dataclass(frozen=True)
class CostOptions:
    """A built strategy's options that change what it costs (``strategy.cost_options()``)."""

    recompute: bool | str = False  # activation checkpointing: False, "full" or "selective"
    cpu_offload: bool = False
    disk_offload: bool = False  # zero3_offload's offload_dir: the offloaded states in files
    #: FSDP's knobs: gathered-parameter and reduction dtypes (None: the precision's), prefetch depth,
    #: reshard after forward (None: the mesh strategies decide: not with a pipeline)
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    prefetch: int = 1
    reshard_after_forward: bool | None = True
    grad_sync: str = "every_micro_batch"  # FSDP's gradient reduction with accumulation
    zero2_collectives: str = "reduce_scatter"
    #: expert_parallel / 3d: how the data axis holds the non-expert states (None: the entry's default)
    data_parallel: str | None = None
    #: pipelines: a schedule even at pp == 1 (the pipeline strategy on one device), its name, the
    #: configured micro-batch count (None: pp) and virtual stages per rank
    pipelined: bool = False
    schedule: str = "1f1b"
    n_microbatches: int | None = None
    virtual_stages: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    #: float8 matmuls (``model.float8``): None, "tensorwise" or "rowwise"
    float8: str | None = None

    def microbatches_for(self, pp: int) -> int:
        """Micro-batches per step of a pipeline of ``pp`` stages (1 without a pipeline)."""
        if not (self.pipelined or pp > 1):
            return 1
        return self.n_microbatches if self.n_microbatches is not None else pp
