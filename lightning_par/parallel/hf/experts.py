"""Expert parallelism for a Hugging Face experts module (plain torch, duck-typed).

transformers' MoE families declare their experts in the config's ``base_model_ep_plan`` (style
``ep_dispatch_experts``): one module per MoE layer holding every expert's weights stacked on dim 0
(``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I), biases (E, ...)), called by the sparse block
as ``experts(hidden_states, top_k_index, top_k_weights)``. transformers' own expert parallelism
keeps every token on every rank and all-reduces the partial sums; here tokens travel to the rank
that owns their expert by all-to-all, as for our own MoE (``expert_parallel.EPDispatch``), so each
rank computes only its own tokens' assignments.

``install`` gives the module a forward that

1. sorts this rank's (token, slot) assignments by expert and dispatches the rows (``EPDispatch``);
2. runs the received rows through **the module's own forward** on this rank's slice of the stacked
   weights (the DTensors' local shards, the gradient scaled by 1/ep as ``Experts.grad_scale`` does),
   with each row routed to its local expert at weight 1 -- so whatever the family computes inside an
   expert (gated activations, clamps, biases, the implementation transformers selected) is its own;
3. returns the rows to their tokens and applies the routing weights there, summing each token's
   slots into its output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: ANN001
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad * ctx.scale, None


@contextlib.contextmanager
def _local_weights(mod: nn.Module, n_local: int, grad_scale: float) -> Iterator[None]:
    """Within the block, ``mod``'s stacked parameters read as this rank's local slices (plain tensors
    whose gradient flows into the DTensor parameter) and ``mod.num_experts`` as ``n_local``."""
    saved = dict(mod._parameters)
    had_n = "num_experts" in mod.__dict__
    old_n = mod.__dict__.get("num_experts")
    try:
        for name, p in saved.items():
            if p is not None and hasattr(p, "to_local"):
                local = p.to_local()
                mod._parameters[name] = _ScaleGrad.apply(local, grad_scale) if grad_scale != 1.0 else local
        if had_n:
            mod.__dict__["num_experts"] = n_local
        yield
    finally:
        mod._parameters.update(saved)
        if had_n:
            mod.__dict__["num_experts"] = old_n


class _LocalExperts:
    """What ``EPDispatch`` calls on the received rows: the module's own forward, every row routed to
    the local expert its block belongs to, at weight 1 (the weights are applied on the sending rank)."""

    def __init__(self, mod: nn.Module, forward: Any, n_local: int, weight_dtype: torch.dtype) -> None:
        self.mod, self.forward, self.n_local, self.weight_dtype = mod, forward, n_local, weight_dtype
        self.last_a2a_bytes = 0

    def __call__(self, x: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        index = torch.repeat_interleave(torch.arange(self.n_local, device=x.device),
                                        torch.tensor(per_expert, device=x.device)).unsqueeze(1)
        ones = torch.ones(index.shape, dtype=self.weight_dtype, device=x.device)
        with _local_weights(self.mod, self.n_local, self.mod.grad_scale):
            return self.forward(self.mod, x, index, ones)


def install(mod: nn.Module, dispatch: Any, n_experts: int) -> None:
    """Give the Hugging Face experts module ``mod`` (its stacked parameters already DTensors sharded
    on dim 0 over the ep group of ``dispatch``) the all-to-all forward described above."""
    own_forward = type(mod).forward  # the class's (transformers' implementation switch included)
    n_local = dispatch.n_local

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if hidden_states.is_meta:  # shapes only (FLOP counting): every assignment as if it stayed here
            with _local_weights(mod, n_local, 1.0):
                return own_forward(mod, hidden_states, top_k_index % n_local, top_k_weights)
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert; a token's slots in slot order
        token = order // k
        counts = torch.bincount(flat, minlength=n_experts + 1)  # last bucket: dropped rows (none here)
        local = _LocalExperts(mod, own_forward, n_local, top_k_weights.dtype)
        rows = dispatch(local, hidden_states[token], counts)
        mod.last_a2a_bytes = local.last_a2a_bytes
        weights = top_k_weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, token, (rows * weights).to(out.dtype))

    mod.forward = forward
