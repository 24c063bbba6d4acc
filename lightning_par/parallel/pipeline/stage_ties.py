"""A weight shared by two pipeline stages (plain torch): Megatron-LM's embedding group.

A language model whose output head reuses its input embedding holds that one weight in two layers
that a pipeline puts on different stages: the embedding on the first, the head on the last. Each
rank holding a use keeps its own copy, and the copies are kept equal:

- after materialisation the copy of the rank holding the first use is broadcast to the others (the
  model's initialisation of the second use alone may differ from that of the shared weight);
- after every backward the copies' gradients are summed over the ranks holding one (the gradient of
  a shared weight is the sum of its uses' gradients), so every copy takes the same optimizer step;
- global-norm clipping counts the weight once (``norm_excluded``: the copies of the later uses).

When both uses sit on one rank (one stage, or the V layout of ``zbv`` putting the first and last
stage on pipeline rank 0) they stay one parameter and nothing is communicated. The groups are
2-rank groups like Megatron's, one per pipeline group of the mesh (each data / tensor coordinate),
created on every rank in the same order. Local shards are what travels: the copies are split alike
by tensor parallelism (both by vocabulary rows) and by FSDP (same shape, same data mesh).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def layer_of(name: str, layers: Sequence[str]) -> str | None:
    """The declared pipeline layer holding parameter ``name`` (its longest path prefix), or None."""
    best = None
    for layer in layers:
        if name.startswith(layer + ".") and (best is None or len(layer) > len(best)):
            best = layer
    return best


@dataclass
class StageTie:
    """One shared weight: its names on this rank (the first use's, if held here, first), whether this
    rank holds the first use, and the group of ranks holding a use (None: every use is here)."""

    names: tuple[str, ...]
    holds_first: bool
    group: dist.ProcessGroup | None
    src: int  # global rank holding the first use


def plan_stage_ties(pairs: Sequence[tuple[str, str]], layers: Sequence[str], rank_of_layer: Callable[[str], int],
                    mesh: DeviceMesh) -> list[StageTie]:
    """The ties this rank takes part in. ``pairs``: (first use, other use) parameter names of the whole
    model before the cut; ``rank_of_layer``: the pipeline rank holding a layer. Every rank must call
    this with the same arguments (it creates process groups). ``ValueError`` (one line) for a shared
    weight outside every pipeline layer, which no stage would own."""
    names = list(mesh.mesh_dim_names or ())
    pp_dim = names.index("pp")
    # every pipeline group of the mesh: the global ranks along pp, for each coordinate of the other axes
    groups = mesh.mesh.movedim(pp_dim, -1).reshape(-1, mesh.mesh.shape[pp_dim]).tolist()
    me = dist.get_rank()
    mine = next(g for g in groups if me in g)
    my_pp = mine.index(me)
    by_weight: dict[str, list[str]] = {}
    for first, other in pairs:
        by_weight.setdefault(first, [first]).append(other)
    out = []
    for first, uses in by_weight.items():
        where = []
        for name in uses:
            layer = layer_of(name, layers)
            if layer is None:
                raise ValueError(f"pipeline: {name} shares its weight with {first} but lies outside every "
                                 f"pipeline layer, so no stage owns it; use pp=1 or untie it")
            where.append(rank_of_layer(layer))
        ranks = sorted(set(where))
        group = None
        if len(ranks) > 1:
            for g in groups:  # collective: every rank creates every group, in the same order
                created = dist.new_group([g[r] for r in ranks])
                if g is mine:
                    group = created
        if my_pp in ranks:
            here = tuple(n for n, r in zip(uses, where) if r == my_pp)
            out.append(StageTie(here, where[0] == my_pp, group, mine[where[0]]))
    return out


@torch.no_grad()
def broadcast_first_copy(module: nn.Module, ties: Sequence[StageTie]) -> None:
    """Give every copy the values of the first use's copy (after materialisation)."""
    for tie in ties:
        if tie.group is not None:
            dist.broadcast(_local(module.get_parameter(tie.names[0]).data), src=tie.src, group=tie.group)


@torch.no_grad()
def sum_tied_gradients(module: nn.Module, ties: Sequence[StageTie]) -> None:
    """Sum the copies' gradients over the ranks that hold one (after backward, before the step)."""
    for tie in ties:
        if tie.group is None:
            continue
        p = module.get_parameter(tie.names[0])
        if not p.requires_grad:  # frozen (a LoRA model's base): no copy has a gradient to sum
            continue
        if p.grad is None:  # this use took no part in this step's loss: it still joins the sum
            p.grad = torch.zeros_like(p)
        if hasattr(p.grad, "placements") and tuple(p.grad.placements) != tuple(p.placements):
            # a vocabulary-split embedding's gradient can come back Replicate: lay it out like the
            # parameter, so both copies' local shards are the same rows
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        dist.all_reduce(_local(p.grad), group=tie.group)


def norm_excluded(module: nn.Module, ties: Sequence[StageTie]) -> set[int]:
    """ids of the copies that global-norm clipping must not count again (all but the first use's)."""
    return {id(module.get_parameter(t.names[0])) for t in ties if t.group is not None and not t.holds_first}
