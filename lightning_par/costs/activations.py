"""Activation memory of the GPT demo model as today's kernels hold it (see docs/cost_model.md).

Every figure is bytes per token of one micro-batch (``n = b * s`` tokens), derived from what each op
saves for backward (checked op by op with ``torch.autograd.graph.saved_tensors_hooks`` and against
``MemTracker``'s peak, tests/test_activation_memory.py). Dtypes: ``c`` is the compute dtype's size
(2 under bf16/16 autocast or bf16-true, 4 in fp32); the residual stream and the LayerNorm inputs
stay in the parameters' dtype ``r`` (fp32 under autocast: the embeddings are fp32 and ``x + attn``
promotes), LayerNorm saves two fp32 statistics per token.

Per transformer layer (h hidden, a heads, m mlp_ratio), fused SDPA (flash / memory-efficient: the
output and an fp32 logsumexp per head, no s x s matrix)::

    2 r h + 16              LayerNorm inputs and their statistics (two LayerNorms)
    c h (6 + 2 m)           ln_1 out (shared by q/k/v), q, k, v, attention out (= o-proj input:
                            the fused kernels return a (B, T, H, D) layout, so no copy), ln_2 out,
                            fc out, GELU out
    4 a                     logsumexp

The math path (CPU with dropout > 0: torch's CPU flash kernel has no dropout) keeps three s x s
tensors per head instead of the logsumexp: softmax output, dropout mask, dropped probabilities.
Dropout masks: one per ``nn.Dropout`` (embedding, attention residual, MLP residual) -- bool on CUDA,
the compute dtype on CPU. Autocast (``bf16-mixed``/``16-mixed``) also keeps a low-precision copy of
every matmul weight for backward (2 bytes per weight element).

Head and loss: final LayerNorm (r h + 8), its output (c h), the fp32 log-softmax output that
cross-entropy saves (4 V; ``loss_fn`` upcasts the logits), the int64 targets (8). While the loss's
backward runs, two more fp32 B x T x V buffers are alive (the incoming gradient and log-softmax's
gradient): the loss transient 8 V per token. Embedding: the int64 token ids (8).

Tensor parallelism (Megatron column/row splits): q/k/v, attention out, fc/GELU outputs and the
logsumexp are split over ``tp``; the LayerNorm inputs are split only with sequence parallelism
(torch's DTensor linears save the all-gathered input, so the LayerNorm outputs stay whole); the
logits are split only with ``loss_parallel``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

#: precision -> (compute dtype bytes, residual / parameter dtype bytes, autocast weight copies)
_DTYPES = {
    "32-true": (4, 4, False),
    "bf16-mixed": (2, 4, True),
    "16-mixed": (2, 4, True),
    "bf16-true": (2, 2, False),
    "paper-mixed": (2, 2, False),
}


@dataclass(frozen=True)
class Shape:
    """A GPT's shape (fields as in ``GPTConfig``) and the sequence length it trains on."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq_len: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    block_size: int | None = None  # the position table's size (None: seq_len)

    @classmethod
    def of(cls, config, seq_len: int | None = None) -> Shape:
        """From a ``GPTConfig`` (or anything with its fields); ``seq_len`` defaults to ``block_size``."""
        return cls(config.n_layer, config.n_embd, config.n_head, config.vocab_size,
                   int(seq_len or getattr(config, "seq_len", None) or config.block_size),
                   getattr(config, "mlp_ratio", 4), float(getattr(config, "dropout", 0.0)), getattr(config, "bias", True),
                   getattr(config, "block_size", None))

    def gpt_config(self):
        from lightning_par.models.gpt import GPTConfig

        return GPTConfig(vocab_size=self.vocab_size, block_size=self.block_size or self.seq_len, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd, mlp_ratio=self.mlp_ratio, dropout=self.dropout,
                         bias=self.bias)

    def units(self) -> dict[str, int]:
        """Parameters of the model's parts, counted from the model built on the meta device:
        ``embed``, ``block`` (one), ``head``, ``lm_head``, ``block_matmul`` (weights a block
        multiplies by), the largest ``nn.Linear`` of a block (``block_linear``) and ``total``."""
        return dict(_unit_params(self))


@lru_cache(maxsize=64)
def _unit_params(shape: Shape) -> tuple[tuple[str, int], ...]:
    import torch
    from torch import nn

    from lightning_par.models.gpt import GPT, GPTConfig

    config = shape.gpt_config()
    one = GPTConfig(**{**config.__dict__, "n_layer": 1})  # one block is every block
    with torch.device("meta"):
        net = GPT(one)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    block = net.blocks[0]
    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    units = {f"block.{name}": m.weight.numel() for name, m in block.named_modules() if isinstance(m, nn.Linear)}
    units |= {"embed": count(net.embed), "block": count(block), "head": count(net.head),
             "lm_head": net.head.lm_head.weight.numel(), "embed_table": net.embed.tok.weight.numel(),
             "block_matmul": sum(m.weight.numel() for m in linears),
             "block_linear": max(m.weight.numel() for m in linears)}
    units["total"] = units["embed"] + config.n_layer * units["block"] + units["head"]
    return tuple(units.items())


def dtypes(precision: str) -> tuple[int, int, bool]:
    if precision not in _DTYPES:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[precision]


def attention_kernel(shape: Shape, device: str = "cuda") -> str:
    """``fused`` (flash or memory-efficient SDPA: O(s) saved state) or ``math`` (s x s scores).

    CUDA: flash (fp16/bf16) or memory-efficient (fp32, head_dim <= 256) kernels take the causal mask
    and dropout. CPU (torch 2.13): ``_scaled_dot_product_flash_attention_for_cpu`` runs for fp32 and
    bf16 without dropout; with dropout SDPA falls back to the math path."""
    head_dim = shape.n_embd // shape.n_head
    if device == "cpu":
        return "math" if shape.dropout > 0 else "fused"
    return "fused" if head_dim <= 256 else "math"


def layer_bytes_per_token(shape: Shape, precision: str, *, device: str = "cuda", tp: int = 1,
                          sequence_parallel: bool = False, selective: bool = False) -> float:
    """Bytes one transformer layer saves for backward, per token (weight copies excluded).
    ``selective``: Korthikanti et al.'s selective recomputation -- the attention core (softmax,
    dropout, scores) is recomputed, so the math path's s x s tensors are not kept (the fused kernels
    keep none anyway)."""
    c, r, _ = dtypes(precision)
    h, a, m, s = shape.n_embd, shape.n_head, shape.mlp_ratio, shape.seq_len
    sp = tp if sequence_parallel else 1
    norms = (2 * r * h + 16) / sp
    whole = 2 * c * h  # ln_1 / ln_2 outputs: inputs of the column-parallel linears
    split = c * h * (4 + 2 * m)  # q, k, v, attention out, fc out, GELU out
    if attention_kernel(shape, device) == "fused":
        split += 4 * a
    elif not selective:
        mask = 1 if device == "cuda" else c
        split += (2 * c + mask) * a * s
    masks = 0.0
    if shape.dropout > 0:
        masks = 2 * h * (1 if device == "cuda" else c) / sp
    return norms + whole + split / tp + masks


def weight_copy_bytes(n_weights: int, precision: str, tp: int = 1) -> int:
    """Autocast's low-precision copies of ``n_weights`` matmul weights (0 outside autocast)."""
    return 2 * n_weights // tp if dtypes(precision)[2] else 0


def head_bytes_per_token(shape: Shape, precision: str, *, tp: int = 1, loss_parallel: bool = False) -> float:
    """Final LayerNorm, its output, the fp32 log-softmax output and the targets, per token."""
    c, r, _ = dtypes(precision)
    v = shape.vocab_size / (tp if loss_parallel else 1)
    return r * shape.n_embd + 8 + c * shape.n_embd + 4 * v + 8


def loss_transient_per_token(shape: Shape, *, tp: int = 1, loss_parallel: bool = False) -> float:
    """Two fp32 B x T x V gradients alive while the loss's backward runs."""
    return 8 * shape.vocab_size / (tp if loss_parallel else 1)


def embed_bytes_per_token(shape: Shape, precision: str, device: str = "cuda") -> float:
    c = dtypes(precision)[0]
    return 8 + (shape.n_embd * (1 if device == "cuda" else c) if shape.dropout > 0 else 0)


def checkpoint_bytes_per_token(shape: Shape, precision: str, tp: int = 1, sequence_parallel: bool = False) -> float:
    """A checkpointed block keeps only its input: the residual stream, in the parameters' dtype."""
    return dtypes(precision)[1] * shape.n_embd / (tp if sequence_parallel else 1)


def layer_backward_transient_per_token(shape: Shape, precision: str, tp: int = 1) -> float:
    """Gradients alive inside one block's backward: the MLP's inner gradient pair (fc out, GELU out)."""
    c = dtypes(precision)[0]
    return 2 * c * shape.mlp_ratio * shape.n_embd / tp


def in_flight_micro_batches(schedule: str, pp: int, n_micro: int, virtual_stages: int = 1) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once: GPipe all ``m``;
    1F1B (and the zero-bubble schedules) at most ``pp``; interleaved 1F1B ``pp (1 + (pp-1)/(pp v))``
    in units of this rank's layers (Narayanan et al. 2021)."""
    if pp <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(n_micro)
    if schedule == "interleaved_1f1b":
        return min(float(n_micro), pp * (1 + (pp - 1) / (pp * max(1, virtual_stages))))
    return float(min(n_micro, pp))
