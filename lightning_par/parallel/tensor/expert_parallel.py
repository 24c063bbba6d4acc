"""Expert parallelism (EP): the routed experts spread over the ``ep`` axis of the mesh, tokens sent to
the ranks that own their experts and brought back with all-to-all (plain torch).

Layout. Each ``Experts`` module's stacked weights (E, ...) become DTensors sharded on dim 0 over
the ep mesh (``Shard(0)``): rank r of an ep group holds experts [r E/ep, (r+1) E/ep). DTensors
rather than plain local slices because everything downstream already speaks DTensor: the
strategy-neutral checkpoint (``torch.distributed.checkpoint`` saves each rank's slice under the
full name and global shape, so an EP checkpoint loads into a single-device model and back),
deferred initialisation (``materialize`` copies each rank's slice of the single-device init),
FSDP2 (``fully_shard`` over the other data axis composes with a DTensor on a sibling mesh axis, as
with tensor parallelism), memory accounting and global-norm clipping. The forward itself uses the
local slice (``to_local``), so no DTensor op runs in the hot path.

Dispatch (``EPDispatch``), per MoE layer and forward, for assignments already sorted by expert:

1. all-to-all of the per-expert counts (E ints): each rank learns how many rows it will receive
   from every source for each of its local experts;
2. one host read of those counts (the split sizes ``all_to_all_single`` needs as Python ints);
3. all-to-all of the token rows with variable splits (the differentiable ``all_to_all_single`` of
   torch's functional collectives: its backward is the reverse all-to-all);
4. the received blocks, ordered (source, local expert), regrouped to (local expert, source), run
   through the local experts, put back in (source, expert) order;
5. the reverse all-to-all returns each row to the rank that routed it, in the order it was sent.

Gradients: every rank's loss is the mean over its own tokens, and an expert's weights receive
gradient from the tokens of all ranks of its ep group: that sum is scaled by 1/ep in backward
(``Experts.grad_scale``), so that averaging over the remaining data axis (FSDP's reduce-scatter,
or the replicate strategy's all-reduce) gives the mean over the whole world. (torchtitan instead
sets FSDP's gradient divide factor to the world size; that needs a pre-multiplied sum, which gloo
does not have.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
# the differentiable all-to-all that torch.distributed.nn.functional's deprecation notice points to
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


class EPDispatch:
    """The token dispatcher of one ``Experts`` module under expert parallelism (see module docstring)."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.n_local = n_experts // self.ep

    def __call__(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, n_local = self.ep, self.n_local
        counts = counts[:-1].contiguous()  # the last bucket holds the dropped rows, sorted last: not sent
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [source][local expert]
        both = torch.stack([counts, received]).tolist()  # the one host read of the split sizes
        x = x[:sum(both[0])]
        send = [sum(both[0][r * n_local:(r + 1) * n_local]) for r in range(ep)]
        recv_blocks = [both[1][s * n_local:(s + 1) * n_local] for s in range(ep)]
        recv = [sum(b) for b in recv_blocks]
        rows = all_to_all_single_autograd(x, recv, send, self.group)
        # (source, expert) blocks -> (expert, source) blocks, so each local expert's rows are contiguous
        blocks = rows.split([n for b in recv_blocks for n in b])
        by_expert = [blocks[s * n_local + e] for e in range(n_local) for s in range(ep)]
        per_expert = [sum(recv_blocks[s][e] for s in range(ep)) for e in range(n_local)]
        y = experts(torch.cat(by_expert) if by_expert else rows, per_expert)
        out_blocks = y.split([recv_blocks[s][e] for e in range(n_local) for s in range(ep)])
        back = torch.cat([out_blocks[e * ep + s] for s in range(ep) for e in range(n_local)]) if out_blocks else y
        out = all_to_all_single_autograd(back, send, recv, self.group)
        me = dist.get_rank(self.group)
        rows_out = sum(send) - send[me] + sum(recv) - recv[me]  # rows that leave this rank: dispatch, combine
        # forward and backward: each direction's rows go once in the input's dtype (dispatch forward,
        # its gradient back) and once in the experts' output dtype (combine forward, its gradient back)
        # -- they differ under autocast; the counts only in forward
        experts.last_a2a_bytes = (rows_out * x.shape[-1] * (x.element_size() + y.element_size())
                                  + counts.numel() * counts.element_size())
        return out


def check_expert_parallel(ep: int, n_experts: int, model: str) -> None:
    """One-line ``ValueError`` when ``ep`` cannot split ``n_experts`` evenly."""
    if n_experts and n_experts % ep:
        raise ValueError(f"expert parallelism: n_experts={n_experts} of {model} is not divisible by ep={ep}; "
                         f"choose an ep that divides {n_experts}")


def apply_expert_parallel(module: nn.Module, *, ep_mesh: DeviceMesh, experts: Sequence[str],
                          install: Callable[[nn.Module, Any, int], None] | None = None) -> list[nn.Module]:
    """Shard every expert module in ``experts`` (paths in ``module``) on dim 0 over ``ep_mesh`` and give
    it the all-to-all dispatcher. Works on a meta-device model (nothing is allocated). Returns them."""
    done = []
    for path in experts:
        mod = module.get_submodule(path)
        for name, b in mod.named_buffers():  # per-expert state the split would leave whole: wrong silently
            if b.dim() and mod._parameters and b.shape[0] == next(iter(mod._parameters.values())).shape[0]:
                raise ValueError(f"expert parallelism: {type(mod).__name__} at {path} holds a per-expert buffer "
                                 f"{name!r} that only its parameters' split would cover; use ep=1")
        for name, p in list(mod.named_parameters(recurse=False)):
            n = p.shape[0]
            check_expert_parallel(ep_mesh.size(), n, type(module).__name__)
            mod.register_parameter(name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None),
                                                      requires_grad=p.requires_grad))
        dispatch = EPDispatch(ep_mesh.get_group(), n)
        if hasattr(mod, "dispatch"):  # our ``Experts``: it calls its dispatcher itself
            mod.dispatch = dispatch
        elif install is not None:  # the plan's installer (a Hugging Face experts module: its forward is wrapped)
            install(mod, dispatch, n)
        else:
            raise ValueError(f"expert parallelism: {type(mod).__name__} at {path} neither calls a dispatcher "
                             "(a `dispatch` attribute) nor has an installer in the model's plan; use ep=1")
        mod.grad_scale = 1.0 / ep_mesh.size()  # the ep group's summed gradient -> its mean (see Experts)
        done.append(mod)
    return done


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module`` sharded by ``apply_expert_parallel`` (DTensors with ``Shard(0)`` on
    an ``ep`` mesh axis); FSDP keeps them DTensors, with the dp axis added in front."""
    out = []
    for p in module.parameters():
        if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ()):
            out.append(p)
    return out


def shard_experts(experts: Sequence[nn.Module], *, mesh: DeviceMesh, reshard_after_forward: bool = True,
                  param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None) -> None:
    """FSDP2 on each expert module over ``mesh`` (the data axis beside ep), before the model's other
    units: the experts' parameters become 2-D DTensors (dp sharded x ep sharded), their gradients
    averaged over ``mesh`` (after the 1/ep of ``Experts.grad_scale``: the mean over the world)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    for mod in experts:
        fully_shard(mod, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))


def data_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """One mesh over every data rank of ``mesh`` (its dp_replicate, dp_shard and ep axes; flattened
    into ``dp_ep`` when there are several): the group the non-expert parameters are averaged or
    FSDP-sharded over. Call once per mesh (flattening registers the name on the root mesh)."""
    names = mesh.mesh_dim_names or ()
    data = tuple(n for n in ("dp_replicate", "dp_shard", "ep") if n in names)
    if not data:
        return None
    return mesh[data]._flatten("dp_ep") if len(data) > 1 else mesh[data[0]]


def average_replicated_gradients(module: nn.Module, mesh: DeviceMesh, data: DeviceMesh) -> None:
    """Data parallelism without FSDP beside expert parallelism, after backward: the non-expert
    gradients averaged over every data rank (``data``), the experts' over dp_replicate only (their
    ep group's sum already became a mean through ``Experts.grad_scale``). Averaging the whole
    accumulated gradient after every backward is exact: the part averaged before is equal everywhere."""
    from lightning_par.parallel.sharding.gradients import average_gradients

    experts = {id(p) for p in expert_parameters(module)}
    average_gradients([p for p in module.parameters() if id(p) not in experts], data.get_group())
    names = mesh.mesh_dim_names or ()
    if "dp_replicate" in names and mesh["dp_replicate"].size() > 1:
        average_gradients([p for p in module.parameters() if id(p) in experts], mesh["dp_replicate"].get_group())
