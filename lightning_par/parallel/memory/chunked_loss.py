"""Chunked linear cross-entropy: the output head and the loss computed a chunk of tokens at a time, so the
full-vocabulary logits and their gradient never exist at once (``model.chunked_loss``).

At 4 x 2048 tokens and a 128,256-entry vocabulary, the fp32 logits the loss upcasts to are 4 GiB, and their
gradient 4 GiB more. Here the model's output layer becomes a pass-through (``make_chunked``: the module keeps its
class's parameters and state-dict keys, so checkpoints, pretrained loading, FSDP and the TP plan see the same
layer) and the model returns the hidden states it would have projected. The loss (``ChunkedHead.loss``) then
projects ``chunk_tokens`` tokens at a time, each chunk under non-reentrant activation checkpointing: forward keeps
only the chunk's hidden states and targets, and backward recomputes one chunk's logits, takes their gradient and
frees them before the next. The price is the head's forward matmul once more in backward.

Parallel layouts (the layer's weight as the strategy left it when the loss runs):

- a plain tensor (single, DDP, ZeRO-1/2, FSDP's unsharded root parameters -- FSDP2 keeps the root's parameters
  gathered from forward to backward): the projection and ``F.cross_entropy``, in fp32, per chunk;
- a DTensor split on the vocabulary over a tensor-parallel axis (``shard_vocab`` is the TP style the plan's
  ``output`` layer gets when chunked): each rank projects onto its vocabulary rows and the loss is the
  vocabulary-parallel cross-entropy (``_VocabParallelCE``: max, sum of exponentials and the target's logit
  all-reduced over the axis, Megatron-LM's). Written here rather than through torch's ``loss_parallel()``, which
  needs its context around the backward too; a checkpointed chunk is recomputed inside whatever backward runs
  it (a pipeline schedule's, Lightning's), which this code does not own. Under sequence parallelism the
  sequence shards are gathered first (the ``output`` style's own input layout).
- an FSDP shard (the layer's unit resharded before the loss ran): refused in one line. The loss runs after the
  model's forward, so ``parallelize`` has the root unit holding the layer not reshard after that forward (FSDP2's
  own default for a root). In the app's training step (an FSDP forward method around the model's forward) the
  root is still resharded when the step returns and gathered again for backward, as without the chunked loss;
  after a pipeline's last stage it stays gathered to backward, as a pipeline's FSDP units do here anyway.

The mean is over the targets that are not ``ignore_index`` (-100), as ``F.cross_entropy``'s. A model whose
forward changes the logits after the output layer (soft-capping, scaling) is refused by its model class
(``HFCausalLM``): the loss here would skip that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils.checkpoint import checkpoint

#: tokens per chunk when ``chunked_loss=true``: at a 128,256 vocabulary one chunk's fp32 logits are 0.5 GiB
DEFAULT_CHUNK_TOKENS = 1024
IGNORE_INDEX = -100


@dataclass(frozen=True)
class ChunkedLoss:
    """``chunked_loss``'s value: tokens per chunk."""

    chunk_tokens: int = DEFAULT_CHUNK_TOKENS


def chunked_loss_option(value: object) -> ChunkedLoss | None:
    """``false``/``true``/a positive token count -> the option (None: off); else ``ValueError``, one line."""
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("false", "off", "none")):
        return None
    if value is True or (isinstance(value, str) and value.lower() in ("true", "on")):
        return ChunkedLoss()
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return ChunkedLoss(value)
    raise ValueError(f"chunked_loss={value!r}: choose false, true or a positive number of tokens per chunk")


class ChunkedHead(nn.Module):
    """Mixed into the output layer's own class (``make_chunked``): its call returns its input, and ``loss``
    projects and takes the cross-entropy chunk by chunk. Set by ``make_chunked`` (``chunk_tokens``) and, under
    tensor parallelism, ``ShardVocab`` (``tp_mesh``, ``tp_sequence_sharded``)."""

    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    tp_mesh: object = None
    tp_sequence_sharded: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x

    def loss(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the projection of ``hidden`` (..., C) onto the vocabulary against ``target``."""
        weight, bias = self.weight, getattr(self, "bias", None)
        group, start = None, 0
        if isinstance(weight, DTensor):
            weight, bias, group, start = _vocab_shard(weight, bias, self)
        if group is not None and self.tp_sequence_sharded:
            # (B, T/tp, C) on each rank: the whole sequence, as the output style gathers it; in backward each rank's
            # vocabulary share of the gradient (a partial sum) is reduce-scattered back onto the sequence shard
            mesh = self.weight.device_mesh
            if not isinstance(hidden, DTensor):
                hidden = DTensor.from_local(hidden, mesh, [Shard(1)], run_check=False)
            hidden = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        elif group is not None:
            from lightning_par.parallel.tensor.tp_styles import _copy_to_tp

            hidden = _copy_to_tp(hidden, group)  # every rank's vocabulary share adds to the hidden state's gradient
        h = hidden.reshape(-1, hidden.shape[-1])
        t = target.reshape(-1)
        total = h.new_zeros((), dtype=torch.float32)
        for i in range(0, h.shape[0], self.chunk_tokens):
            total = total + checkpoint(_chunk_sum, h[i:i + self.chunk_tokens], t[i:i + self.chunk_tokens], weight,
                                       bias, group, start, use_reentrant=False)
        return total / (t != IGNORE_INDEX).sum()


def _vocab_shard(weight: DTensor, bias: torch.Tensor | None, head: ChunkedHead) -> tuple:
    """This rank's part of a head whose weight is a DTensor when the loss runs: (weight, bias, group, first row).
    Split on the vocabulary over the tensor-parallel axis ``ShardVocab`` gave it: those rows and the axis's group;
    replicated: the whole; sharded any other way (an FSDP shard: the layer's unit resharded before the loss): a
    one-line error -- a loss on a shard would be silently wrong."""
    tp_mesh = getattr(head, "tp_mesh", None)
    local_bias = bias.to_local() if isinstance(bias, DTensor) else bias
    if all(p == Replicate() for p in weight.placements):
        return weight.to_local(), local_bias, None, 0
    if tp_mesh is None or weight.device_mesh != tp_mesh or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"chunked_loss: the output layer's weight is sharded as {tuple(weight.placements)} over "
                         f"{weight.device_mesh} when the loss runs (its FSDP unit resharded after forward): "
                         "chunked_loss needs it gathered there, as the model's root unit keeps it")
    local = weight.to_local()
    return local, local_bias, tp_mesh.get_group(), tp_mesh.get_local_rank() * local.shape[0]


def _chunk_sum(h: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               group: object, start: int) -> torch.Tensor:
    """The summed cross-entropy of one chunk (its logits live only in here)."""
    logits = F.linear(h, weight, bias).float()
    if group is None:
        return F.cross_entropy(logits, t, reduction="sum", ignore_index=IGNORE_INDEX)
    return _VocabParallelCE.apply(logits, t, start, group)


class _VocabParallelCE(torch.autograd.Function):
    """The summed cross-entropy of logits split on the vocabulary over ``group`` (each rank its rows
    ``start .. start + V/tp``): the row maximum, the sum of exponentials and the target's logit all-reduced."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, start: int, group: object) -> torch.Tensor:  # noqa: ANN001
        import torch.distributed as dist

        local_v = logits.shape[-1]
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        valid = target != IGNORE_INDEX
        mine = valid & (target >= start) & (target < start + local_v)
        index = torch.where(mine, target - start, torch.zeros_like(target))
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * mine
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(picked, group=group)
        dist.all_reduce(total, group=group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), index, mine, valid)
        return ((total.log() - picked) * valid).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
        softmax, index, mine, valid = ctx.saved_tensors
        out = softmax * valid.unsqueeze(-1)
        out.scatter_add_(-1, index.unsqueeze(-1), -mine.to(out.dtype).unsqueeze(-1))
        return out * grad, None, None, None


_CLASSES: dict[type, type] = {}


def make_chunked(layer: nn.Module, option: ChunkedLoss) -> nn.Module:
    """Turn ``layer`` (an ``nn.Linear`` with ``nn.Linear``'s forward: ``weight`` (V, C), optional ``bias``) into a
    ``ChunkedHead`` in place: same object, same parameters, its class a subclass of its own class; else
    ``ValueError``, one line."""
    cls = type(layer)
    if not isinstance(layer, nn.Linear) or (cls.forward is not nn.Linear.forward and not isinstance(layer, ChunkedHead)):
        # the loss computes ``F.linear(h, weight, bias)``: anything else the layer's own forward does would be lost
        raise ValueError(f"chunked_loss: the output layer is a {cls.__name__} with a forward of its own, not an "
                         "nn.Linear the loss can compute in chunks")
    if not isinstance(layer, ChunkedHead):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Chunked{cls.__name__}", (ChunkedHead, cls), {"__module__": __name__})
        layer.__class__ = _CLASSES[cls]
    layer.chunk_tokens = option.chunk_tokens
    return layer


def chunked_head(module: nn.Module) -> ChunkedHead | None:
    """The chunked output layer in ``module`` (a pipeline stage without it: None)."""
    return next((m for m in module.modules() if isinstance(m, ChunkedHead)), None)


class ShardVocab:
    """The tensor-parallel style of a chunked output layer (the plan's ``output`` style when chunked): its weight
    (and bias) split on the vocabulary rows, no input or output hooks -- the layer's call passes the hidden states
    through and ``ChunkedHead.loss`` projects them; under sequence parallelism it gathers them first."""

    def __init__(self, *, sequence_parallel: bool) -> None:
        self.sequence_parallel = sequence_parallel

    def apply(self, module: nn.Module, mesh: object, where: str) -> None:
        from lightning_par.parallel.tensor.tp_styles import shard_param

        for name in ("weight", "bias"):
            if isinstance(module._parameters.get(name), torch.Tensor):
                shard_param(module, name, Shard(0), mesh, f"{where}.{name}")
        module.tp_mesh = mesh
        module.tp_sequence_sharded = self.sequence_parallel
