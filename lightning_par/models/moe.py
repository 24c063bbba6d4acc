"""A mixture-of-experts decoder: the GPT of ``gpt.py`` with the MLP of every ``moe_every``-th block
replaced by a routed MoE layer. Architecture only: how the experts are spread over ranks is
``parallel/tensor/expert_parallel.py``'s business; this file only calls a token *dispatcher* that by
default runs every expert here.

The MoE layer (``MoE``):

- a top-k token-choice router (``router``: a linear map to ``n_experts`` logits), gated by softmax
  or sigmoid scores; with top_k > 1 the k chosen scores are renormalised to sum to 1 (Mixtral with
  softmax, DeepSeek-V3 with sigmoid);
- experts stored as stacked weights ``experts.w1`` (E, C, F) and ``experts.w2`` (E, F, C), so
  expert parallelism shards dim 0;
- an optional shared expert (a plain MLP every token goes through);
- a load-balancing loss (Switch Transformer's E * sum_e f_e * P_e) and the router z-loss (ST-MoE's
  mean squared logsumexp of the logits), both scaled by their coefficients and left in
  ``aux_loss`` for the LightningModule to add to the training loss;
- capacity: ``capacity_factor=None`` is dropless; otherwise each expert takes at most
  ceil(capacity_factor * T * k / E) tokens *of each sequence* (first come, first served in token
  order) and drops the rest (they pass through the residual connection only).

The balance loss and the capacity are both taken per sequence, not per batch: a sequence never
crosses ranks, so their values do not depend on how the batch is split over data-parallel ranks
-- which is what makes a sharded run's losses equal the single-device run's (loss parity).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lightning_par.models.gpt import GPT, MLP, Block, GPTConfig, count_on_meta, gpt_plan
from lightning_par.parallel.contract import ParallelPlan

GATINGS = ("softmax", "sigmoid")


@dataclass
class MoEConfig(GPTConfig):
    n_experts: int = 4
    top_k: int = 2
    moe_every: int = 1  # block i is an MoE block when (i + 1) % moe_every == 0
    expert_hidden: int | None = None  # inner size of one expert; None: mlp_ratio * n_embd
    gating: str = "softmax"
    shared_expert: bool = False
    capacity_factor: float | None = None  # None: dropless
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gating not in GATINGS:
            raise ValueError(f"MoEConfig: gating must be one of {', '.join(GATINGS)}, got {self.gating!r}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"MoEConfig: top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if self.moe_every < 1:
            raise ValueError(f"MoEConfig: moe_every must be >= 1, got {self.moe_every}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"MoEConfig: capacity_factor must be > 0 or null (dropless), got {self.capacity_factor}")

    @property
    def hidden(self) -> int:
        return self.expert_hidden or self.mlp_ratio * self.n_embd

    def is_moe(self, layer: int) -> bool:
        return (layer + 1) % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layer))

    @property
    def n_expert_params(self) -> int:
        """Parameters in the routed experts (what expert parallelism divides by ep)."""
        return self.n_moe_layers * self.n_experts * 2 * self.n_embd * self.hidden

    @property
    def n_params(self) -> int:
        return count_on_meta(lambda: MoEGPT(self))

    @property
    def active_params(self) -> int:
        """Parameters one token goes through (top_k of the routed experts)."""
        return self.n_params - self.n_expert_params * (self.n_experts - self.top_k) // self.n_experts


# From a CPU toy to realistic shapes (Mixtral-8x7B-like: 8 experts top-2; a fine-grained
# DeepSeek/Qwen-MoE-like layout: 64 experts top-8 with a shared expert and sigmoid gating).
PRESETS: dict[str, dict] = {
    "moe_tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=128, n_experts=4, top_k=2),
    "moe_small": dict(n_layer=4, n_head=4, n_embd=128, block_size=128, n_experts=8, top_k=2, moe_every=2),
    "moe_8x_top2": dict(n_layer=32, n_head=32, n_embd=4096, block_size=4096, vocab_size=32000, bias=False,
                        n_experts=8, top_k=2, expert_hidden=14336),
    "moe_64x_top8": dict(n_layer=28, n_head=16, n_embd=2048, block_size=4096, vocab_size=102400, bias=False,
                         n_experts=64, top_k=8, expert_hidden=1408, shared_expert=True, gating="sigmoid"),
}


def is_training_forward(module: nn.Module) -> bool:
    """Whether ``module`` is running one of training's forwards now: in training mode, with gradients
    on (an eval or ``no_grad`` forward is none), and not an activation checkpoint's recompute -- that
    runs inside backward, and torch has no public flag for it, hence the private graph-task id (-1
    outside any backward). (A *reentrant* checkpoint's first forward runs without gradients: not
    counted either; the project's checkpointing is non-reentrant.)"""
    return module.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


class Dispatcher(Protocol):
    """Runs ``experts`` on rows sorted by expert: ``counts[e]`` rows for expert e in order, then
    ``counts[E]`` dropped rows (ignored). Returns the outputs of the kept rows, in the same order."""

    def __call__(self, experts: "Experts", x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor: ...


def run_local(experts: "Experts", x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every expert on this rank: no communication."""
    experts.last_a2a_bytes = 0
    n = counts.numel() - 1
    if x.is_meta:  # FLOP counting on the meta device: no values, so assume an even spread, nothing dropped
        split = [x.shape[0] // n] * n
        split[-1] += x.shape[0] - sum(split)
        return experts(x, split)
    split = counts.tolist()  # the split sizes as Python ints: one host read per layer
    return experts(x[:sum(split[:n])], split[:n])


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _AddAuxLossGrad(torch.autograd.Function):
    """Identity on ``x`` in forward; in backward also gives ``aux`` the gradient ``scale`` -- as if
    ``scale * aux`` had been added to the loss (used where the loss cannot carry it: a pipeline stage)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class Experts(nn.Module):
    """``n`` GELU MLPs as stacked weights; ``forward`` runs the experts this rank holds on their rows.

    ``grad_scale`` (1 here) multiplies the weights' gradient of every backward: under expert
    parallelism an expert's gradient sums the losses of the ep ranks whose tokens it served, and
    ``parallel/tensor/expert_parallel.py`` sets 1/ep to make that sum a mean like every other gradient's.
    """

    def __init__(self, n: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))
        self.dispatch: Dispatcher = run_local  # replaced by parallel/tensor/expert_parallel.py under EP
        self.last_a2a_bytes = 0  # bytes this rank sends by all-to-all for its last forward (and its backward)
        self.grad_scale = 1.0

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # to_local: under expert parallelism the weights are DTensors and this rank holds its experts only
        w1 = self.w1.to_local() if hasattr(self.w1, "to_local") else self.w1
        w2 = self.w2.to_local() if hasattr(self.w2, "to_local") else self.w2
        if self.grad_scale != 1.0:
            w1, w2 = _ScaleGrad.apply(w1, self.grad_scale), _ScaleGrad.apply(w2, self.grad_scale)
        # a loop over the local experts: a grouped matmul (torch._grouped_mm) is CUDA-only and private
        out = [F.gelu(chunk @ w1[e]) @ w2[e] for e, chunk in enumerate(x.split(counts))]
        return torch.cat(out) if out else x.new_zeros(0, x.shape[-1])


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.n_embd, cfg.hidden)
        self.shared = MLP(cfg) if cfg.shared_expert else None
        self.aux_loss: torch.Tensor | None = None
        # AuxLossSource (parallel/contract.py): set under a pipeline, where the loss cannot carry aux_loss
        self.aux_grad_scale: float | None = None
        # one entry per training forward since the reader last cleared them (device tensors, no host
        # read): assignments per expert, dropped ones, assignments, all-to-all bytes, aux loss
        self._forwards: list[tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor | None]] = []

    @property
    def last_stats(self) -> dict[str, Any]:
        """The figures of the last training forward -- under a pipeline, of this step's micro-batches,
        summed; {} when there was none since ``clear_stats``."""
        if not self._forwards:
            return {}
        tokens, dropped, assignments, a2a, _ = zip(*self._forwards)
        return {"tokens_per_expert": torch.stack(tokens).sum(0), "dropped": torch.stack(dropped).sum(0),
                "assignments": sum(assignments), "a2a_bytes": sum(a2a)}

    @property
    def aux_sum(self) -> torch.Tensor | None:
        """The auxiliary losses this layer fed into backward itself (``aux_grad_scale`` set), summed."""
        aux = [f[4] for f in self._forwards if f[4] is not None]
        return torch.stack(aux).sum() if aux else None

    def clear_stats(self) -> None:
        self._forwards = []

    def keep_last_forwards(self, n: int) -> None:
        """Forget all but the last ``n`` forwards: torch's pipeline stages run one more forward on
        their first step to infer shapes (with whatever the receive buffers hold), not a micro-batch."""
        self._forwards = self._forwards[-n:] if n else []

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(expert index (B, T, k), gate weight (B, T, k), kept (B, T, k) bool); sets ``aux_loss``."""
        cfg = self.cfg
        b, t, _ = x.shape
        logits = self.router(x).float()  # (B, T, E)
        scores = logits.softmax(-1) if cfg.gating == "softmax" else logits.sigmoid()
        top, idx = scores.topk(cfg.top_k, dim=-1)  # (B, T, k)
        weight = top / top.sum(-1, keepdim=True) if cfg.top_k > 1 else top
        onehot = F.one_hot(idx, cfg.n_experts).to(scores.dtype)  # (B, T, k, E)
        # balance loss per sequence: f = share of the sequence's assignments, p = its mean normalised score
        f = onehot.sum((1, 2)) / (t * cfg.top_k)  # (B, E)
        p = (scores / scores.sum(-1, keepdim=True)).mean(1)  # (B, E)
        balance = cfg.n_experts * (f * p).sum(-1).mean()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        self.aux_loss = cfg.aux_loss_coef * balance + cfg.z_loss_coef * z
        if cfg.capacity_factor is None:
            kept = torch.ones_like(idx, dtype=torch.bool)
        else:  # position of each assignment in its expert's queue for this sequence, in token order
            capacity = math.ceil(cfg.capacity_factor * t * cfg.top_k / cfg.n_experts)
            flat = onehot.reshape(b, t * cfg.top_k, cfg.n_experts)
            position = (flat.cumsum(1) * flat).sum(-1).reshape(b, t, cfg.top_k) - 1
            kept = position < capacity
        return idx, weight.to(x.dtype), kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        idx, weight, kept = self.route(x)
        tokens = x.reshape(-1, c)
        expert = idx.reshape(-1)
        token = torch.arange(b * t, device=x.device).repeat_interleave(self.cfg.top_k)
        n = self.cfg.n_experts
        # dropped assignments go to an extra bucket n, sorted last; no data-dependent shapes up to the
        # dispatcher (which also lets the FLOP counter run this on the meta device)
        bucket = torch.where(kept.reshape(-1), expert, n)
        order = torch.argsort(bucket, stable=True)  # group the assignments by expert
        counts = F.one_hot(bucket, n + 1).sum(0)
        token, gate = token[order], weight.reshape(-1)[order]
        y = self.experts.dispatch(self.experts, tokens[token], counts)
        if y.shape[0] < token.shape[0]:  # the dropped rows: no expert output
            y = torch.cat([y, y.new_zeros(token.shape[0] - y.shape[0], c)])
        out = torch.zeros_like(tokens).index_add_(0, token, y * gate.unsqueeze(-1))
        stats = (counts[:n].detach(), counts[n].detach(), bucket.numel(), self.experts.last_a2a_bytes)
        out = out.reshape(b, t, c)
        out = out + self.shared(x) if self.shared is not None else out
        aux = None
        if self.aux_grad_scale is not None and torch.is_grad_enabled() and self.aux_loss is not None:
            out = _AddAuxLossGrad.apply(out, self.aux_loss, self.aux_grad_scale)
            aux = self.aux_loss.detach()
        if is_training_forward(self):  # not an eval / no_grad forward, nor a checkpoint's recompute
            # a pipeline (aux_grad_scale set) clears them every step and keeps its micro-batches; else
            # one forward per batch: the last one replaces any the monitor did not read (nothing piles up)
            self._forwards = [*self._forwards, (*stats, aux)] if self.aux_grad_scale is not None else [(*stats, aux)]
        return out


class MoEBlock(Block):
    """The GPT block with its MLP replaced by ``MoE`` (``moe=True``) or kept (``moe=False``)."""

    def __init__(self, cfg: MoEConfig, moe: bool) -> None:
        super().__init__(cfg, mlp=MoE(cfg) if moe else None)


class MoEGPT(GPT):
    """The GPT (embedding, blocks, head, init rule) with every ``moe_every``-th block's MLP routed."""

    config: MoEConfig

    def make_block(self, layer: int) -> nn.Module:
        return MoEBlock(self.config, self.config.is_moe(layer))

    def init_weights(self, module: nn.Module) -> None:
        """The GPT's rule; the stacked expert weights like an MLP's: w1 as its fc, w2 as its residual proj."""
        if isinstance(module, Experts):
            std = 0.02
            nn.init.normal_(module.w1, mean=0.0, std=std)
            nn.init.normal_(module.w2, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))
        else:
            super().init_weights(module)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the MoE layers' auxiliary losses from the last forward (None before any)."""
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def parallel_plan(self) -> ParallelPlan:
        return moe_plan(self.config)


def moe_plan(cfg: MoEConfig) -> ParallelPlan:
    """Blocks (FSDP / checkpointing units), layers (pipeline cuts), the expert modules, and the GPT's
    tensor-parallel styles: the attention and the dense blocks' MLPs are split as in the GPT, while an
    MoE layer (router, experts, shared expert) runs whole on every tensor-parallel rank -- its input
    is replicated there, so every tp rank routes the same tokens (no expert tensor parallelism)."""
    blocks = tuple(f"blocks.{i}" for i in range(cfg.n_layer))
    experts = tuple(f"blocks.{i}.mlp.experts" for i in range(cfg.n_layer) if cfg.is_moe(i))
    dense = gpt_plan(cfg)
    tp_plan = {k: v for k, v in dense.tp_plan.items() if not k.startswith("blocks.*.mlp.")}
    tp_plan |= {f"blocks.{i}.mlp.{name}": style for i in range(cfg.n_layer) if not cfg.is_moe(i)
                for name, style in (("fc", "colwise"), ("proj", "rowwise"))}
    divisible = {k: v for k, v in dense.tp_divisible.items() if k != "mlp hidden" or cfg.n_moe_layers < cfg.n_layer}
    return ParallelPlan(layers=("embed", *blocks, "head"), blocks=blocks, experts=experts, n_experts=cfg.n_experts,
                   tp_plan=tp_plan, tp_divisible=divisible)
