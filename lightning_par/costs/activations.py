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

from lightning_par import dtypes as _dtypes
from lightning_par.costs.states import PRECISIONS, check


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
    # mixture of experts (models/moe.py's MoEConfig; n_experts == 0: a dense GPT)
    n_experts: int = 0
    top_k: int = 0
    moe_every: int = 1
    expert_hidden: int = 0  # one expert's inner size (0: mlp_ratio * n_embd)
    shared_expert: bool = False

    @property
    def n_moe_layers(self) -> int:
        """Blocks whose MLP is a routed MoE layer (block i when (i + 1) % moe_every == 0)."""
        return self.n_layer // self.moe_every if self.n_experts else 0

    @property
    def moe_hidden(self) -> int:
        return self.expert_hidden or self.mlp_ratio * self.n_embd

    @classmethod
    def of(cls, config, seq_len: int | None = None) -> Shape:
        """From a ``GPTConfig`` (or anything with its fields); ``seq_len`` defaults to ``block_size``."""
        n_experts = int(getattr(config, "n_experts", 0) or 0)
        moe = dict(n_experts=n_experts, top_k=int(config.top_k), moe_every=int(config.moe_every),
                   expert_hidden=int(config.expert_hidden or 0), shared_expert=bool(config.shared_expert)) \
            if n_experts else {}
        return cls(config.n_layer, config.n_embd, config.n_head, config.vocab_size,
                   int(seq_len or getattr(config, "seq_len", None) or config.block_size),
                   getattr(config, "mlp_ratio", 4), float(getattr(config, "dropout", 0.0)), getattr(config, "bias", True),
                   getattr(config, "block_size", None), **moe)

    def gpt_config(self, dense: bool = False):
        """The model's config: a ``GPTConfig``, or a ``MoEConfig`` for an MoE shape (``dense``: the
        GPT of the same dimensions, whose blocks are the MoE model's dense blocks)."""
        from lightning_par.models.gpt import GPTConfig

        fields = dict(vocab_size=self.vocab_size, block_size=self.block_size or self.seq_len, n_layer=self.n_layer,
                      n_head=self.n_head, n_embd=self.n_embd, mlp_ratio=self.mlp_ratio, dropout=self.dropout,
                      bias=self.bias)
        if not self.n_experts or dense:
            return GPTConfig(**fields)
        from lightning_par.models.moe import MoEConfig

        return MoEConfig(**fields, n_experts=self.n_experts, top_k=self.top_k, moe_every=self.moe_every,
                         expert_hidden=self.expert_hidden or None, shared_expert=self.shared_expert)

    def units(self) -> dict[str, int]:
        """Parameters of the model's parts, counted from the model built on the meta device:
        ``embed``, ``block`` (one), ``head``, ``lm_head``, ``block_matmul`` (weights a block
        multiplies by), the largest ``nn.Linear`` of a block (``block_linear``) and ``total``.
        MoE shapes add ``moe_block`` (one MoE block, experts included), ``moe_experts`` (its routed
        experts, what expert parallelism divides by ep) and ``moe_matmul`` (its router and shared
        expert); ``block`` stays a dense block."""
        return dict(_unit_params(self))


@lru_cache(maxsize=64)
def _unit_params(shape: Shape) -> tuple[tuple[str, int], ...]:
    import fnmatch

    import torch
    from torch import nn

    from lightning_par.models.gpt import GPT, GPTConfig

    config = shape.gpt_config(dense=True)
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
    # what tensor parallelism splits, by the model's own plan (colwise / vocabulary splits: weight and
    # bias; rowwise: the weight, its bias replicated), and tensor counts (ZeRO-2's per-tensor flags)
    plan = net.parallel_plan().tp_plan
    for part, module in (("embed", net.embed), ("block", block), ("head", net.head)):
        prefix = "blocks.0" if part == "block" else part
        split = 0
        for name, m in module.named_modules():
            full = f"{prefix}.{name}" if name else prefix
            style = next((v for k, v in plan.items() if fnmatch.fnmatchcase(full, k.replace("*", "[0-9]*"))), None)
            if style in ("colwise", "embedding", "output"):
                split += sum(p.numel() for p in m.parameters(recurse=False))
            elif style == "rowwise":
                split += m.weight.numel()
        units[f"{part}_tp_split"] = split
        units[f"{part}_tensors"] = len(list(module.parameters()))
    if shape.n_experts:
        from lightning_par.models.moe import MoE, MoEBlock

        moe_config = shape.gpt_config()
        with torch.device("meta"):
            moe_block = MoEBlock(moe_config, moe=True)
        layer = next(m for m in moe_block.modules() if isinstance(m, MoE))
        units["moe_block"] = count(moe_block)
        units["moe_experts"] = count(layer.experts)
        units["moe_matmul"] = units["block_matmul"] - units["block.mlp.fc"] - units["block.mlp.proj"] + sum(
            m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
        units["total"] += shape.n_moe_layers * (units["moe_block"] - units["block"])
    return tuple(units.items())


def dtypes(precision: str) -> tuple[int, int, bool]:
    """(compute dtype bytes, residual / parameter dtype bytes, autocast weight copies) of one of the
    estimator's precisions (``costs/states.py``; dtypes from ``lightning_par/dtypes.py``)."""
    check(precision, PRECISIONS, "precision")
    pr = _dtypes.precision(precision)
    return _dtypes.dtype_bytes(pr.compute), _dtypes.dtype_bytes(pr.param), pr.autocast


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
    if shape.n_moe_layers:  # the average layer: MoE layers keep more than the dense MLP they replace
        split += shape.n_moe_layers / shape.n_layer * (moe_bytes_per_token(shape, precision) - 2 * c * m * h)
    return norms + whole + split / tp + masks


def moe_bytes_per_token(shape: Shape, precision: str) -> float:
    """What one routed MoE layer (models/moe.py) saves for backward per token, in place of the dense
    MLP's fc and GELU outputs (its input, ln_2's output, is counted with the layer)::

        k (3 c h + 2 c F + 36)   per assignment (k = top_k): the gathered token row, the expert's
                                 output and its gated copy (c h each), the expert's inner activation
                                 before and after GELU (c F each), the fp32 gate and three int64
                                 indices (top-k choice, sort order, token of the row)
        8 E + 4                  fp32 router logits (kept by the z-loss's logsumexp) and scores
                                 (softmax / sigmoid output), the logsumexp
        2 c m h                  the shared expert's fc and GELU outputs, when there is one

    Counted with ``saved_tensors_hooks`` (within 0.3% on four layouts, fp32) and checked against
    MemTracker's peak in tests/test_moe_costs.py. Under expert parallelism the same rows are kept by
    the rank that runs their expert: per rank the figure holds for balanced routing (each rank
    receives as many rows as it sends); a skewed router moves activation memory to the ranks of the
    popular experts (the load balance of the run summary's ``moe`` says by how much).
    """
    c = dtypes(precision)[0]
    k, h, f = shape.top_k, shape.n_embd, shape.moe_hidden
    shared = 2 * c * shape.mlp_ratio * h if shape.shared_expert else 0
    return k * (3 * c * h + 2 * c * f + 36) + 8 * shape.n_experts + 4 + shared


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
    dense = 2 * c * shape.mlp_ratio * shape.n_embd / tp
    if not shape.n_moe_layers:
        return dense
    shared = dense if shape.shared_expert else 0
    return max(dense, 2 * c * shape.top_k * shape.moe_hidden + shared)  # an MoE layer: k expert rows per token


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
