"""FSDP's options, one object for every strategy that shards with FSDP2's ``fully_shard``: ``fsdp`` /
``hsdp``, ``zero3`` / ``zero3_offload`` (``fsdp.py``, ``zero.py``), and the mesh strategies with a
dp_shard axis -- ``fsdp_tp``, ``3d``, ``expert_parallel`` with ``data_parallel=fsdp`` (``composite.py``,
``expert_parallel.py``).

Each constructor keeps its own keywords (the yaml keys: ``strategy.reshard_after_forward=false``)
and puts the ones it takes into one ``FSDPOptions``; the rest keep their defaults here. The options
are checked in one place (``check``), become the **fully shard** technique in one place
(``technique``), and read as the strategy's attributes (``strategy.param_dtype``,
``strategy.cpu_offload``: the memory callback and the estimator read them) through ``FSDPOptionsMixin``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_par.core.dtypes import parse_dtype
from lightning_par.parallel.layout import CostOptions
from lightning_par.parallel.parallelize import FullyShard


@dataclass(frozen=True)
class FSDPOptions:
    """FSDP's knobs as the strategies' constructors take them.

    Attributes:
        units: the modules sharded as units: ``"blocks"`` (the model's blocks), a class name, a
            minimum parameter count, or module paths (``parallel/sharding/fsdp.py``'s ``resolve_units``).
        reshard_after_forward: free gathered parameters after forward (ZeRO-3); False keeps them until
            backward. None (the mesh strategies): True without a pipeline, False with one.
        prefetch: units whose all-gather each unit issues ahead, in forward and backward.
        param_dtype / reduce_dtype: mixed precision (``bf16``, ``fp16``, ``fp32`` or None): the dtype of
            the gathered parameters used for compute, and of the gradient reduction.
        cpu_offload: parameter shards, gradients and optimizer state live in host memory.
    """

    units: int | str | Sequence[str] = "blocks"
    reshard_after_forward: bool | None = True
    prefetch: int = 1
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.units, (str, int)):  # paths (a yaml list): a tuple, so the options stay frozen
            object.__setattr__(self, "units", tuple(self.units))
        elif isinstance(self.units, str) and self.units.strip().isdigit():
            # a size passed as text (a command line parsed by type hints that try str first): no module path
            # or class name is all digits
            object.__setattr__(self, "units", int(self.units))

    def check(self, owner: str) -> None:
        """One-line ``ValueError`` for an option FSDP cannot take (``owner``: the strategy's name)."""
        parse_dtype(self.param_dtype, "param_dtype")
        parse_dtype(self.reduce_dtype, "reduce_dtype")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"{owner}: prefetch must be an integer >= 0, got {self.prefetch!r}")

    def technique(self, mesh: Any, *, reshard_default: bool | None = None) -> FullyShard:
        """The **fully shard** step over ``mesh``; ``reshard_default``: what ``reshard_after_forward=None``
        means (the mesh strategies: not with a pipeline, else every micro-batch gathers again)."""
        reshard = reshard_default if self.reshard_after_forward is None else self.reshard_after_forward
        # units given by class name or size are resolved when FSDP is applied (after checkpointing
        # has wrapped the blocks, which changes paths below them)
        return FullyShard(mesh=mesh, units=None if self.units == "blocks" else self.units,
                          reshard_after_forward=reshard, param_dtype=parse_dtype(self.param_dtype, "param_dtype"),
                          reduce_dtype=parse_dtype(self.reduce_dtype, "reduce_dtype"), cpu_offload=self.cpu_offload,
                          prefetch=self.prefetch)


def _option(name: str) -> property:
    return property(lambda self: getattr(self.fsdp_options, name), doc=f"``fsdp_options.{name}``")


class FSDPOptionsMixin:
    """The strategy's ``fsdp_options`` fields, read as its attributes (it must come before
    ``ParStrategyMixin`` in the bases: that one says ``cpu_offload = False`` for every other strategy)."""

    fsdp_options: FSDPOptions = FSDPOptions()
    units = _option("units")
    reshard_after_forward = _option("reshard_after_forward")
    prefetch = _option("prefetch")
    param_dtype = _option("param_dtype")
    reduce_dtype = _option("reduce_dtype")
    cpu_offload = _option("cpu_offload")

    def cost_options(self) -> CostOptions:
        o = self.fsdp_options
        return replace(super().cost_options(), cpu_offload=o.cpu_offload, param_dtype=o.param_dtype,  # type: ignore[misc]
                       reduce_dtype=o.reduce_dtype, prefetch=o.prefetch, reshard_after_forward=o.reshard_after_forward)
