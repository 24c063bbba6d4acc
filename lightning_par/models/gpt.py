"""A GPT-style decoder (pre-LayerNorm, causal self-attention through ``scaled_dot_product_attention``
or the backend ``attn_implementation`` names (``models/attention.py``), GELU MLP), its size presets, and
its parallel plan. Architecture only: no parallelism in here.

Structure (paths used by the plan): ``embed`` (token + position embeddings) -> ``blocks.0 ..
blocks.{n_layer-1}`` -> ``head`` (final LayerNorm + vocabulary projection). Each of those maps one
tensor to one tensor, which is what lets a pipeline cut the model between any two of them.
Attention and MLP use separate q/k/v/o and fc/proj linears so a Megatron column/row split is
one line of the plan per linear; attention reads the local head count from the tensor shapes, so
the same code runs on a tensor-parallel shard. The output head is not tied to the embedding (tying
would join the first and last pipeline stages).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_par.models.attention import attend, check_name
from lightning_par.parallel.contract import ParallelPlan


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens by default
    block_size: int = 128  # maximum sequence length (size of the position table)
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block
    n_embd: int = 128  # hidden size; must be divisible by n_head
    mlp_ratio: int = 4  # MLP inner size = mlp_ratio * n_embd
    dropout: float = 0.0  # 0 by default: loss parity needs deterministic forward passes
    bias: bool = True  # biases in linears and LayerNorms
    #: sdpa (torch picks the kernel), sdpa_flash / sdpa_efficient / sdpa_cudnn / sdpa_math (SDPA restricted
    #: to that kernel) or eager (scores written out): ``models/attention.py``
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        check_name(self.attn_implementation, "GPTConfig: attn_implementation")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    @property
    def n_params(self) -> int:
        """Exact parameter count of the model this config builds, counted on the meta device (no
        memory): the one count, which the estimator's ``Shape.units`` and the comm model's shapes
        read the same way."""
        return count_on_meta(lambda: GPT(self))


def count_on_meta(build: Callable[[], nn.Module]) -> int:
    """Parameters of the module ``build`` makes, built on the meta device (shapes only)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


# Presets from a CPU-sized toy to the GPT-2 family and a 7B shape (LLaMA-7B's width and depth).
PRESETS: dict[str, dict] = {
    "gpt_tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=128),
    "gpt_small": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
    "gpt2_medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50304),
    "gpt2_large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024, vocab_size=50304),
    "gpt2_xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=50304),
    "gpt_7b": dict(n_layer=32, n_head=32, n_embd=4096, block_size=2048, vocab_size=32000, bias=False),
}


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))  # (B, T, C)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.wo = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.wo.residual_projection = True  # GPT-2's scaled init (see GPT.init_weights)
        self.dropout = cfg.dropout
        self.attn_implementation = cfg.attn_implementation
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism this rank holds only its share of the heads
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        # the backend restriction is entered inside the call: a checkpointed block's recompute runs the same kernel
        y = attend(self.attn_implementation, q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(b, t, -1)  # (B, T, nh*hs)
        return self.resid_drop(self.wo(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.residual_projection = True  # GPT-2's scaled init (see GPT.init_weights)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm decoder block; ``mlp`` replaces the dense MLP (the MoE model's routed experts)."""

    def __init__(self, cfg: GPTConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = mlp if mlp is not None else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(self.make_block(i) for i in range(cfg.n_layer))
        self.head = Head(cfg)
        self.reset_parameters()

    def make_block(self, layer: int) -> nn.Module:
        """Block ``layer`` of the decoder (the MoE model overrides this to route some blocks' MLPs)."""
        return Block(self.config)

    def reset_parameters(self) -> None:
        for module in self.modules():
            self.init_weights(module)

    def init_weights(self, module: nn.Module) -> None:
        """Initialise the tensors ``module`` itself owns (the model contract's per-submodule init, which
        lets a strategy initialise a meta-device model group by group): GPT-2's normal(0, 0.02),
        scaled by 1/sqrt(2 n_layer) for the projections that write into the residual stream."""
        std = 0.02
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()  # weight 1, bias 0
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            if getattr(module, "residual_projection", False):
                std = std / math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def get_output_embeddings(self) -> nn.Module:
        """The output layer (transformers' name for it): what ``model.chunked_loss`` projects with."""
        return self.head.lm_head

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def parallel_plan(self) -> ParallelPlan:
        return gpt_plan(self.config)


def gpt_plan(config: GPTConfig) -> ParallelPlan:
    """The GPT's parallel plan (a function of its config only: no model needs to be built)."""
    n = config.n_layer
    blocks = tuple(f"blocks.{i}" for i in range(n))
    tp_plan = {
        "embed.tok": "embedding",  # vocabulary rows split over tp ranks
        "embed.pos": "position",  # replicated table; under sequence parallelism each rank adds its slice
        "blocks.*.ln_1": "sequence_parallel",
        "blocks.*.attn.wq": "colwise",  # heads split: W = [W_1 ... W_p]
        "blocks.*.attn.wk": "colwise",
        "blocks.*.attn.wv": "colwise",
        "blocks.*.attn.wo": "rowwise",  # partial sums, one all-reduce per attention
        "blocks.*.ln_2": "sequence_parallel",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",  # one all-reduce per MLP
        "head.ln_f": "sequence_parallel",
        "head.lm_head": "output",  # vocabulary columns split; replicated or loss-parallel output
    }
    divisible = {
        "n_head": config.n_head,
        "mlp hidden": config.mlp_ratio * config.n_embd,
        "vocab_size": config.vocab_size,
    }
    return ParallelPlan(layers=("embed", *blocks, "head"), blocks=blocks, tp_plan=tp_plan, tp_divisible=divisible)
