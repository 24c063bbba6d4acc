"""Fully sharded data parallel (ZeRO stage 3) with FSDP2's ``fully_shard``.

Every parameter is stored as a 1/N shard (a ``DTensor`` sharded on dim 0 over the mesh). A
*unit* is a module whose parameters are all-gathered together just before its forward (and again
before its backward) and freed right after; its gradients are reduce-scattered back to shards. So
a rank holds the shards of everything plus the full parameters of about one unit at a time (two
with prefetch), and units are usually the repeated blocks. The root is wrapped last and takes the
parameters no unit claimed (embeddings, final head).

HSDP: on a 2-D mesh ("dp_replicate", "dp_shard") parameters are sharded within a "dp_shard"
group and replicated across "dp_replicate" groups (gradients all-reduced there) -- sharding stays
inside a node while only the replicas talk across nodes.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from itertools import takewhile

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_par.parallel.init.ties import module_paths, tied_parameters

log = logging.getLogger(__name__)

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def block_classes(model: nn.Module) -> list[str]:
    """Names of the model's own composite classes (not torch.nn building blocks), in model order."""
    seen: dict[str, None] = {}
    for _, mod in model.named_modules():
        cls = type(mod)
        if mod is not model and not isinstance(mod, _CONTAINERS) and not cls.__module__.startswith("torch."):
            seen.setdefault(cls.__name__)
    return list(seen)


def _unknown(model: nn.Module, what: str) -> ValueError:
    classes = ", ".join(block_classes(model)) or "none"
    return ValueError(f"unknown FSDP unit {what} for {type(model).__name__}; its block classes: {classes}")


def resolve_units(model: nn.Module, spec: str | int | Sequence[str]) -> list[str]:
    """Module paths (relative to ``model``, in model order) of the FSDP units described by ``spec``.

    - a list of paths: checked to exist and not to be a ModuleList/ModuleDict (``fully_shard``
      refuses containers; name the blocks inside, e.g. ``blocks.0``);
    - a class name such as ``"Block"``: every submodule of that class (the root excluded);
    - an int: minimum parameter count. Walking bottom-up, a module becomes a unit as soon as the
      parameters under it that no smaller unit took reach the minimum -- the smallest subtrees at
      least that big (FSDP1's ``size_based_auto_wrap_policy``).
    """
    if isinstance(spec, bool):
        raise ValueError(f"FSDP units: expected paths, a class name or a parameter count, got {spec!r}")
    if isinstance(spec, int):
        units: list[str] = []
        seen: set[int] = set()

        def visit(path: str, mod: nn.Module) -> int:
            if id(mod) in seen:  # a module under two parents (a tied tile) is counted, and made a unit, once
                return 0
            seen.add(id(mod))
            left = sum(p.numel() for p in mod.parameters(recurse=False))
            for name, child in mod.named_children():
                left += visit(f"{path}.{name}" if path else name, child)
            if path and left >= spec and not isinstance(mod, _CONTAINERS):
                units.append(path)
                return 0
            return left

        visit("", model)
        order = {name: i for i, (name, _) in enumerate(model.named_modules())}
        return sorted(units, key=order.__getitem__)
    if isinstance(spec, str):
        units = [name for name, mod in model.named_modules() if name and type(mod).__name__ == spec]
        if not units:
            raise _unknown(model, f"class {spec!r}")
        return units
    units = list(spec)
    for path in units:
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            raise _unknown(model, f"path {path!r}") from None
        if isinstance(mod, _CONTAINERS) or not path:
            raise ValueError(f"FSDP unit {path!r} is a container or the root; name the blocks inside it")
    return units


def _dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel part of ``mesh``: ("dp_replicate", "dp_shard") for HSDP, else "dp_shard"."""
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1 or not names:
        return mesh
    dp = tuple(n for n in ("dp_replicate", "dp_shard") if n in names)
    if not dp:
        raise ValueError(f"apply_fsdp: mesh {names} has no 'dp_shard' or 'dp_replicate' axis")
    return mesh[dp] if dp != tuple(names) else mesh


def keep_ties_whole(model: nn.Module, units: list[str]) -> list[str]:
    """``units`` less those holding one use of a shared parameter whose other use lies outside them
    (BERT's MLM decoder tied to its word embeddings, which ``_no_split_modules`` makes a unit): FSDP2
    can shard a parameter in one unit only, so such a parameter is left to the enclosing unit (at
    worst the root), which holds both uses. A unit registered under two parents holds the uses under
    each of its paths (a tied embedding and head's shared tile: one unit, ``tiling.VocabTile``)."""
    ties = tied_parameters(model)
    if not ties:
        return units
    paths = module_paths(model)

    def inside(unit: str, name: str) -> bool:
        return not unit or any(name.startswith(p + ".") for p in paths[id(model.get_submodule(unit))])

    dropped = {u for u in units for a, b in ties if inside(u, a) != inside(u, b)}
    for unit in sorted(dropped):
        log.info("fsdp: %s shares a parameter with a module outside it; left to the enclosing unit", unit)
    return [u for u in units if u not in dropped]


def _distinct(model: nn.Module, units: list[str]) -> list[str]:
    """``units`` with a module named under two of its paths (a tied tile) kept once: it is sharded once."""
    seen: set[int] = set()
    out = []
    for path in units:
        if id(mod := model.get_submodule(path)) not in seen:
            seen.add(id(mod))
            out.append(path)
    return out


def apply_fsdp(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    units: Sequence[str],
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    prefetch: int = 1,
    ignored_params: set[nn.Parameter] | None = None,
    pin_memory: bool = True,
    in_root: nn.Module | None = None,
    root_reshard_after_forward: bool | None = None,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2: each unit in ``units``, then the root. Returns ``model``.

    Args:
        mesh: 1-D (shard) or 2-D ("dp_replicate", "dp_shard") for HSDP; a larger named mesh is
            cut down to those axes (apply tensor parallelism before this).
        units: module paths, listed in forward order (see ``resolve_units``).
        reshard_after_forward: free the gathered parameters after forward (ZeRO-3) and all-gather
            again in backward; False keeps them until backward (ZeRO-2-like, less communication).
        param_dtype / reduce_dtype: compute dtype of the gathered parameters and dtype of the
            gradient reduction (``MixedPrecisionPolicy``); shards stay in their own dtype (fp32).
        cpu_offload: keep parameter shards, gradients and optimizer state in host memory
            (``CPUOffloadPolicy``; the optimizer step then runs on the CPU).
        prefetch: how many following units' all-gathers each unit issues ahead of time, in
            forward and (the preceding units) in backward. 0 leaves FSDP2's defaults: no forward
            prefetch, and FSDP2's implicit one-unit backward prefetch, which cannot be disabled.
        ignored_params: parameters FSDP leaves as they are (``fully_shard``'s ``ignored_params``):
            an MoE layer's experts when their only data axis is the ep axis they are split over.
        pin_memory: with ``cpu_offload`` on CUDA, page-lock the host shards (FSDP2 copies a shard into
            pinned memory otherwise); False for the disk tier, whose shards are views of files.
        in_root: a module that must stay in the root unit (the chunked output layer, whose weight the loss
            reads after forward): ``ValueError`` if a unit holds it.
        root_reshard_after_forward: the root unit's own (None: ``reshard_after_forward``).
    """
    if prefetch < 0:
        raise ValueError(f"apply_fsdp: prefetch must be >= 0, got {prefetch}")
    units = _distinct(model, keep_ties_whole(model, resolve_units(model, list(units))))
    dp_mesh = _dp_mesh(mesh)
    kwargs = dict(
        mesh=dp_mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=CPUOffloadPolicy(pin_memory=pin_memory and torch.cuda.is_available()) if cpu_offload else OffloadPolicy(),
        ignored_params=ignored_params,
    )
    # children before parents: a unit nested in another must be sharded first so it owns its params
    if in_root is not None:
        holder = next((p for p in units if any(m is in_root for m in model.get_submodule(p).modules())), None)
        if holder is not None:
            raise ValueError(f"FSDP unit {holder} holds the chunked output layer, whose weight the loss reads after "
                             "forward: leave it in the root unit (other units), or set chunked_loss=false")
    for path in sorted(units, key=lambda p: -p.count(".")):
        fully_shard(model.get_submodule(path), **kwargs)
    if root_reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = root_reshard_after_forward
    fully_shard(model, **kwargs)
    if prefetch > 0:
        modules: list[FSDPModule] = [model.get_submodule(p) for p in units]  # type: ignore[misc]
        paths = module_paths(model)
        set_prefetch(modules, prefetch, twice={id(m) for m in modules if len(paths[id(m)]) > 1})
    return model


def set_prefetch(modules: list[FSDPModule], prefetch: int, twice: Collection[int] = ()) -> None:
    """Each unit all-gathers the next ``prefetch`` units in forward and the previous ones in backward
    (``modules`` in forward order). Units run twice per forward (``twice``, ids: a tied embedding and
    head's tiles, run at the start and at the end) are chained only among themselves -- their order is
    the same at both uses, what comes before and after is not, and a list fits one use only (a stray
    prefetch holds a unit gathered until its turn). Across that boundary nothing is prefetched in
    forward, and in backward FSDP2's implicit prefetch (of a unit with no list of its own), which
    follows the recorded order of calls, serves both uses."""

    def same_run(a: nn.Module, b: nn.Module) -> bool:
        return (id(a) in twice) == (id(b) in twice)

    for i, mod in enumerate(modules):
        later = list(takewhile(lambda m: same_run(m, mod), modules[i + 1:i + 1 + prefetch]))
        earlier = list(takewhile(lambda m: same_run(m, mod), modules[max(0, i - prefetch):i][::-1]))
        if later:
            mod.set_modules_to_forward_prefetch(later)
        if earlier:
            mod.set_modules_to_backward_prefetch(earlier)
