"""Parallel dimensions and the device mesh built from them.

``ParallelDims`` holds the degree of every axis (1 = off), checks that their product is the world
size, and builds a named ``DeviceMesh`` containing only the axes that are on. Axes are always
fetched by name (``dims.dp``, ``mesh["tp"]``), never by position, so a strategy never assumes a
1-D mesh. Axis order, outermost first: pp, dp_replicate, dp_shard, ep, tp -- tensor parallelism is
innermost so its groups are neighbouring ranks (same node), pipeline outermost (crosses nodes).
``ep`` (expert parallelism) is a data axis too: its ranks see different batches and exchange
tokens with all-to-all (``parallel/tensor/expert_parallel.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pp", "dp_replicate", "dp_shard", "ep", "tp")
#: the axes over which ranks see different data, outermost first
DATA_AXES = ("dp_replicate", "dp_shard", "ep")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism; every field is the size of one mesh axis (1 means the axis is off).

    Attributes:
        pp: pipeline stages (vertical model split).
        dp_replicate: data-parallel replicas holding full copies (DDP, or HSDP's replicate axis).
        dp_shard: data-parallel ranks that shard model states (ZeRO / FSDP's shard axis).
        tp: tensor-parallel ranks (horizontal split of each weight matrix).
        ep: expert-parallel ranks: each holds 1/ep of the routed experts and its own batch.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in AXES:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims: {name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.ep * self.tp

    @property
    def dp(self) -> int:
        """Total data-parallel degree: the number of different batches processed per step."""
        return self.dp_replicate * self.dp_shard * self.ep

    def sizes(self) -> dict[str, int]:
        """Axis name -> size, for the axes that are on (all of them when everything is off)."""
        on = {name: getattr(self, name) for name in AXES if getattr(self, name) > 1}
        return on or {"dp_shard": 1}

    def validate(self, world_size: int) -> None:
        if self.world_size != world_size:
            detail = " x ".join(f"{k}={v}" for k, v in self.sizes().items())
            raise ValueError(
                f"mesh sizes {detail} multiply to {self.world_size}, but the world size is {world_size};"
                " make their product equal trainer.devices x trainer.num_nodes"
            )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build the named device mesh (needs an initialized default process group)."""
        sizes = self.sizes()
        mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes.keys()))
        if self.dp_replicate > 1 and self.dp_shard > 1:
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return mesh


def dp_coordinates(mesh: DeviceMesh | None, dims: ParallelDims) -> tuple[int, int]:
    """(rank, size) of this process along the data-parallel dimension (replicate x shard, replicate
    outermost). Computed from the two axes: a flattened "dp" axis is not among the root mesh's
    dimension names, and either axis alone gives the wrong size under HSDP."""
    if mesh is None or dims.dp == 1:
        return 0, 1
    names = mesh.mesh_dim_names or ()
    rank, size = 0, 1
    for axis in DATA_AXES:
        if axis in names:
            sub = mesh[axis]
            rank, size = rank * sub.size() + sub.get_local_rank(), size * sub.size()
    return rank, size


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
