"""Tensor-parallel styles that run on this rank's local shards, and the style names.

torch's ``ColwiseParallel``/``RowwiseParallel`` take only ``nn.Linear``/``nn.Embedding``, and no torch
style splits a packed weight per part (``q|k|v``, ``gate|up``) or computes an experts module's partial
sums; transformers' plans use all of these (``packed_colwise``, ``moe_tp_experts``, ``local_params``,
...). ``LocalParallel`` implements them on DTensor parameters with Megatron-LM's pair of conjugate
all-reduces around the module's own forward; ``tensor_parallel.py`` picks a style per plan entry
(torch's own where it applies) and applies the plan. Also here: the checkpoint helpers for packed
tensors (DCP's planner refuses their layout, see ``gather_packed``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.distributed.tensor.parallel.style import ParallelStyle

STYLES = ("colwise", "rowwise", "embedding", "output", "sequence_parallel", "position", "replicate",
          "colwise_gather", "rowwise_split", "embedding_colwise", "replicate_local_heads", "packed_colwise",
          "packed_rowwise", "moe_experts", "moe_identity", "local_params", "all_reduce", "mla_kv_a_proj",
          "divide_attrs")
#: styles that take one argument after a colon: ``packed_colwise:3`` (parts packed along the split dim, default
#: 2), ``mla_kv_a_proj:8`` (the rotary part's width), ``divide_attrs:split_size,num_heads`` (attributes / tp)
_ARG_STYLES = ("packed_colwise", "packed_rowwise", "mla_kv_a_proj", "divide_attrs")
#: styles a plan may give a parameter (the path ends in a parameter's name): they only shard it; the
#: module owning it runs on local tensors (``moe_experts`` or ``local_params`` on that module)
PARAM_STYLES = ("colwise", "rowwise", "packed_colwise", "packed_rowwise")


def parse_style(name: str) -> tuple[str, str]:
    base, _, arg = name.partition(":")
    if base not in STYLES or (arg and base not in _ARG_STYLES):
        raise ValueError(f"unknown tensor-parallel style {name!r}; expected one of {', '.join(STYLES)}")
    return base, arg



class _CopyToTP(torch.autograd.Function):
    """Megatron-LM's ``f``: identity forward, all-reduce of the gradient in backward. A replicated
    input feeding a rank's shard of a split weight gets only that shard's part of its gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron-LM's ``g``: all-reduce forward (the ranks' partial sums), identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:  # noqa: ANN001
        x = x.contiguous().clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
        return grad, None


class _PartSlices(torch.autograd.Function):
    """A replicated packed bias -> this rank's slice of each of its parts (``b_q[r]|b_k[r]|b_v[r]``); in
    backward the slices' gradients are put back in place and summed over the ranks, so every rank holds
    the whole (replicated) gradient."""

    @staticmethod
    def forward(ctx, b: torch.Tensor, parts: int, world: int, rank: int, group: object) -> torch.Tensor:  # noqa: ANN001
        ctx.shape, ctx.parts, ctx.world, ctx.rank, ctx.group = b.shape, parts, world, rank, group
        return torch.cat([c.chunk(world)[rank] for c in b.chunk(parts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
        full = grad.new_zeros(ctx.shape)
        pieces = grad.chunk(ctx.parts)
        for c, piece in zip(full.chunk(ctx.parts), pieces):
            c.chunk(ctx.world)[ctx.rank].copy_(piece)
        torch.distributed.all_reduce(full, group=ctx.group)
        return full, None, None, None, None


def _copy_to_tp(x: object, group: object) -> object:  # noqa: ANN001
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.requires_grad and torch.is_grad_enabled():
        return _CopyToTP.apply(x, group)
    return x


def _reduce_from_tp(x: object, group: object) -> object:  # noqa: ANN001
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        return _ReduceFromTP.apply(x, group)
    return x


#: where a weight's output and input features lie, by module class name (transformers' ``Conv1D``,
#: GPT-2's, stores ``(in, out)``: the transpose of ``nn.Linear``'s ``(out, in)``)
#: and the attribute holding the output width, which a column split divides (``Conv1D.forward`` views its
#: output with ``nf``)
ORIENTATION = {"Linear": (0, 1, "out_features"), "Conv1D": (1, 0, "nf")}
_LOCAL_KINDS = ("packed_colwise", "packed_rowwise", "moe_experts", "moe_identity", "local_params", "all_reduce",
                "mla_kv_a_proj", "divide_attrs")


def param_placement(style: str, param: torch.Tensor, *, owner: nn.Module | None = None) -> Placement:
    """The placement a style gives ``param``: split features (colwise: outputs, rowwise: inputs), per
    packed part for ``packed_*`` (``_StridedShard``: rank r holds its slice of every part, so a fused
    ``gate|up`` or ``q|k|v`` weight splits into the local ``gate_r|up_r``); a rowwise bias is replicated
    (added once, after the reduction). ``owner`` set: ``param`` is that module's weight/bias (its class
    gives the orientation, ``ORIENTATION``); else a plan names the parameter itself (transformers'
    convention for stacked expert weights ``(E, ..., out, in)``: colwise dim -2, rowwise dim -1)."""
    base, arg = parse_style(style)
    parts = int(arg or 2) if base.startswith("packed_") else 1
    col = base in ("colwise", "packed_colwise")
    if param.ndim == 1:
        if not col or (parts > 1 and owner is not None):
            # a packed module's bias stays replicated and is sliced per part in forward (``_PartSlices``):
            # FSDP2 shards dim 0 too, and composes its shard with a TP ``Shard(0)`` but not with a
            # ``_StridedShard(0)`` (its declared layout would then differ from the data it holds)
            return Replicate()
        dim = 0
    elif owner is not None:
        orient = ORIENTATION.get(type(owner).__name__)
        if orient is None:
            raise ValueError(f"tensor-parallel style {style!r} on a {type(owner).__name__}: no known weight "
                             f"orientation (known: {', '.join(ORIENTATION)})")
        dim = orient[0] if col else orient[1]
    else:
        dim = param.ndim - 2 if col else param.ndim - 1
    return _StridedShard(dim, split_factor=parts) if parts > 1 else Shard(dim)


def shard_param(module: nn.Module, name: str, placement: Placement, mesh: DeviceMesh, where: str,
                src_data_rank: int | None = 0) -> None:
    """Replace ``module``'s parameter ``name`` with a DTensor of ``placement`` (one line if the split
    dim does not divide: packed parts x tp)."""
    param = module._parameters[name]
    if isinstance(param, DTensor):
        return
    if isinstance(placement, Shard):  # _StridedShard included
        parts = placement.split_factor if isinstance(placement, _StridedShard) else 1
        size = param.shape[placement.dim]
        if size % (parts * mesh.size()):
            raise ValueError(f"tensor parallelism cannot split {where}: its dim {placement.dim} ({size}) is not "
                             f"divisible by {parts} packed part(s) x tp={mesh.size()}")
    dt = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


class LocalParallel(ParallelStyle):
    """The styles whose forward runs on this rank's local shards (transformers' packed, expert and
    local styles; colwise/rowwise on a module that is not ``nn.Linear``, e.g. GPT-2's ``Conv1D``).

    torch's ``ColwiseParallel``/``RowwiseParallel`` only accept ``nn.Linear``/``nn.Embedding``, and no
    torch style splits a packed weight per part or computes an experts module's partial sums, so these
    are written here: the parameters are DTensors (``Shard``/``_StridedShard``/``Replicate``; the
    optimizer, clipping, checkpoints and materialisation see the real layout), the module's forward sees
    their local tensors (``to_local`` is differentiable, so gradients land on the DTensors), and the
    communication is Megatron-LM's pair of conjugate all-reduces around it:

    - ``colwise``/``packed_colwise``: input replicated (gradient all-reduced in backward), output the
      local feature shard (``packed``: ``q_r|k_r|v_r``, ``gate_r|up_r``);
    - ``rowwise``/``packed_rowwise``: input the local shard, output all-reduced; the bias is added once
      after the reduction;
    - ``moe_experts`` (transformers' ``moe_tp_experts``): an experts module whose stacked weights the
      plan split by parameter entries; hidden states and routing weights in (gradients all-reduced), the
      ranks' partial outputs summed;
    - ``moe_identity``: an identity expert inside such a module: its input divided by tp, as the sum
      over ranks adds it tp times;
    - ``local_params``: only the local tensors (a module using a split parameter itself: attention sinks);
    - ``all_reduce``: the module's output summed over the ranks;
    - ``mla_kv_a_proj:R``: a replicated projection whose last R outputs (the rotary key, read by this
      rank's heads only) get their gradient all-reduced; the rest passes through a colwise split that
      does so already;
    - ``divide_attrs:a,b``: integer attributes divided by tp (a forward that sizes its split or view by
      a config count, e.g. GPT-2's ``split_size``, OPT's ``num_heads``), nothing else.
    """

    def __init__(self, kind: str, arg: str = "") -> None:
        super().__init__()
        self.kind, self.arg = kind, arg

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        kind, mesh = self.kind, device_mesh
        group = mesh.get_group()
        if kind == "divide_attrs":
            for attr in self.arg.split(","):
                value = getattr(module, attr)
                if not isinstance(value, int) or value % mesh.size():
                    raise ValueError(f"tensor parallelism: {type(module).__name__}.{attr}={value!r} is not divisible "
                                     f"by tp={mesh.size()}")
                setattr(module, attr, value // mesh.size())
            return module
        style = {"colwise": "colwise", "rowwise": "rowwise"}.get(kind, kind)
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue  # split by a parameter entry of the plan
            if style in PARAM_STYLES:
                place = param_placement(style + (f":{self.arg}" if self.arg else ""), param, owner=module)
            else:
                place = Replicate()
            shard_param(module, name, place, mesh, f"{type(module).__name__}.{name}", self.src_data_rank)
        orient = ORIENTATION.get(type(module).__name__)
        if kind in ("colwise", "packed_colwise") and orient is not None:
            setattr(module, orient[2], getattr(module, orient[2]) // mesh.size())  # the local output width
        row = kind in ("rowwise", "packed_rowwise")
        state: dict[str, object] = {}

        def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple:
            originals = {n: p for n, p in mod._parameters.items() if isinstance(p, DTensor)}
            local = {n: p.to_local() for n, p in originals.items()}
            if kind == "packed_colwise":  # the replicated bias: this rank's slice of each part
                for n, p in originals.items():
                    if p.ndim == 1 and p.placements[0].is_replicate():
                        local[n] = _PartSlices.apply(local[n], int(self.arg or 2), mesh.size(),
                                                     mesh.get_local_rank(), group)
            bias = None
            if row and "bias" in local:  # add it once, after the reduction
                bias, local["bias"] = local["bias"], torch.zeros_like(local["bias"])
            mod._parameters.update(local)
            state[id(mod)] = (originals, bias)
            if kind in ("colwise", "packed_colwise", "moe_experts") and args:
                args = (_copy_to_tp(args[0], group), *args[1:])
            if kind == "moe_experts" and len(args) >= 3:  # (hidden, top_k_index, top_k_weights, ...)
                args = (*args[:2], _copy_to_tp(args[2], group), *args[3:])
            if kind == "moe_identity" and args:
                args = (args[0] / mesh.size(), *args[1:])
            return args, kwargs

        def post(mod: nn.Module, args: tuple, kwargs: dict, out: object) -> object:
            originals, bias = state.pop(id(mod))
            mod._parameters.update(originals)
            if kind in ("rowwise", "packed_rowwise", "moe_experts", "all_reduce"):
                out = _reduce_from_tp(out, group)
            if bias is not None:
                out = out + bias
            if kind == "mla_kv_a_proj":
                rope = int(self.arg)
                passed, rot = out.split([out.shape[-1] - rope, rope], dim=-1)
                out = torch.cat([passed, _copy_to_tp(rot, group)], dim=-1)
            return out

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, with_kwargs=True)
        return module



def _packed(x: object) -> bool:
    return isinstance(x, DTensor) and isinstance(x.placements[-1], _StridedShard)


def has_packed(obj: object) -> bool:
    """Whether ``obj`` (a state dict, nested) holds a packed tensor-parallel tensor."""
    if isinstance(obj, dict):
        return any(has_packed(v) for v in obj.values())
    if isinstance(obj, list):
        return any(has_packed(v) for v in obj)
    return _packed(obj)


def gather_packed(obj: object) -> object:
    """``obj`` (a state dict, nested) with every packed tensor-parallel tensor replicated over the tp axis.

    A rank's share of a packed weight (``_StridedShard``: its slice of every part) is several blocks of
    the full tensor, while DCP's planner describes one block per rank and refuses the save ("overlapping
    chunks"). Checkpoints therefore hold such tensors replicated over tp -- the same canonical tensor,
    written once -- and ``scatter_packed`` slices them back on load. Collective: every rank calls it on
    the same structure."""
    if isinstance(obj, dict):
        return {k: gather_packed(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [gather_packed(v) for v in obj]
    if _packed(obj):
        return obj.redistribute(obj.device_mesh, [*obj.placements[:-1], Replicate()])
    return obj


def scatter_packed(loaded: object, original: object) -> object:
    """Undo ``gather_packed``: copy each loaded replicated tensor's slices into the packed tensor it stood
    for (in place) and return the structure with the originals back in their places."""
    # a value the loaded structure lacks keeps the template's own, as when the template itself is loaded into
    if isinstance(original, dict):
        if not isinstance(loaded, dict):
            return original
        return {k: scatter_packed(loaded[k], v) if k in loaded else v for k, v in original.items()}
    if isinstance(original, list):
        if not isinstance(loaded, list):
            return original
        return [scatter_packed(a, b) for a, b in zip(loaded, original)] + original[len(loaded):]
    if _packed(original):
        piece = distribute_tensor(loaded.to_local(), original.device_mesh, original.placements, src_data_rank=None) \
            if original.device_mesh.ndim == 1 else loaded.redistribute(original.device_mesh, original.placements)
        with torch.no_grad():
            original.to_local().copy_(piece.to_local())
        return original
    return loaded
