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

The math path (CPU with dropout > 0: torch's CPU flash kernel has no dropout; ``sdpa_math``) and eager
attention keep s x s tensors per head instead of the logsumexp (``scores_bytes``: the softmax output,
with dropout its mask and the dropped probabilities); the math path also computes in fp32, so it keeps
q, k and v in fp32 (``attention_kernel``, ``scores_bytes``; measured op by op, tests/test_attention.py).
Dropout masks: one per ``nn.Dropout`` (embedding, attention residual, MLP residual) -- bool on CUDA,
the compute dtype on CPU. Autocast (``bf16-mixed``/``16-mixed``) also keeps a low-precision copy of
every matmul weight for backward (2 bytes per weight element).

Head and loss: final LayerNorm (r h + 8), its output (c h), the fp32 log-softmax output that
cross-entropy saves (4 V; ``loss_fn`` upcasts the logits), the int64 targets (8). While the loss's
backward runs, two more fp32 B x T x V buffers are alive (the incoming gradient and log-softmax's
gradient): the loss transient 8 V per token. The chunked loss (``model.chunked_loss``) saves no logits
and holds one chunk's 4 V + 8 V while that chunk's backward runs. Embedding: the int64 token ids (8).

Tensor parallelism (Megatron column/row splits): q/k/v, attention out, fc/GELU outputs and the
logsumexp are split over ``tp``; the LayerNorm inputs are split only with sequence parallelism
(torch's DTensor linears save the all-gathered input, so the LayerNorm outputs stay whole); the
logits are split only with ``loss_parallel``.

Hugging Face decoders (``models/hf/causal_lm.py``: Llama, Qwen2 and GPT-2 as ``hf_config`` builds them; a
``Shape`` with ``hf_arch``) save what their own modules save, counted the same way
(``hf_layer_bytes_per_token``): RMSNorm's fp32 statistics, one autocast copy of a norm's output per
linear that reads it, grouped-query k/v at their own width, a gated MLP's four inner tensors.
Their parameters are counted from the transformers model itself (``Shape.units``), built from the
config's sizes and every further field that differs from the architecture's defaults (``hf_extra``:
biases, rotary parameters, ...), so the count is transformers' own.

This module holds the byte formulas only: the ``Shape`` they read is ``costs/shape.py``'s, the
parameter counts and the model's paths are ``costs/counting.py``'s.
"""

from __future__ import annotations

from lightning_par.core import dtypes as _dtypes
# the shape these formulas read (``costs/shape.py``; re-exported: run/memory_check.py, tests/fsdp_peak_probe.py
# and benchmarks/bench_step_time.py import it from here) and the activations they know
from lightning_par.costs.counting import block_linears
from lightning_par.costs.shape import ACT_SAVED, HF_ARCHS, Shape  # noqa: F401 -- HF_ARCHS re-exported
from lightning_par.costs.states import PRECISIONS, check


def dtypes(precision: str) -> tuple[int, int, bool]:
    """(compute dtype bytes, residual / parameter dtype bytes, autocast weight copies) of one of the
    estimator's precisions (``costs/states.py``; dtypes from ``lightning_par/core/dtypes.py``)."""
    check(precision, PRECISIONS, "precision")
    pr = _dtypes.precision(precision)
    return _dtypes.dtype_bytes(pr.compute), _dtypes.dtype_bytes(pr.param), pr.autocast


def attention_kernel(shape: Shape, device: str = "cuda", precision: str | None = None) -> str:
    """``fused`` (flash, memory-efficient or cuDNN SDPA: O(s) saved state), ``math`` (SDPA's math path: s x s
    scores, computed in fp32) or ``eager`` (the scores written out, ``attn_implementation=eager``).

    ``shape.attn_implementation`` (``models/attention.py``) decides first: eager, sdpa_math (math), sdpa_flash /
    sdpa_efficient / sdpa_cudnn (fused; where they cannot run the run is refused before launch). For ``sdpa``
    torch picks the kernel. CUDA: flash (fp16/bf16) or memory-efficient (fp32, head_dim <= 256) kernels take
    the causal mask and dropout. CPU (torch 2.13): ``_scaled_dot_product_flash_attention_for_cpu`` runs for fp32 and
    bf16 without dropout; with dropout SDPA falls back to the math path. Grouped-query attention
    (transformers passes ``enable_gqa``): the CPU flash kernel and CUDA's flash kernel take k/v at their
    own width, CUDA's memory-efficient kernel does not, so fp32 compute on CUDA (``precision``) runs
    the math path -- torch's dispatch rule, not measured here (no GPU)."""
    name = shape.attn_implementation
    if name == "eager":
        return "eager"
    if name == "sdpa_math":
        return "math"
    if name != "sdpa":
        return "fused"
    head_dim = shape.n_embd // shape.n_head
    if device == "cpu":
        return "math" if shape.dropout > 0 else "fused"
    if shape.n_kv_heads != shape.n_head and precision is not None and dtypes(precision)[0] == 4:
        return "math"
    return "fused" if head_dim <= 256 else "math"


def scores_bytes(shape: Shape, precision: str, *, device: str = "cuda", kernel: str | None = None) -> float:
    """Bytes per score (per token, head and key position: times ``a s`` per token) that attention keeps for
    backward: 0 for the fused kernels (their logsumexp is 4 bytes per head and token). Measured with
    ``saved_tensors_hooks`` on CPU (fp32, bf16-mixed, bf16-true; tests/test_attention.py)::

        math    4 [+ m + 4]     torch's math path upcasts fp16/bf16 q, k, v to fp32: the fp32 softmax output;
                                with dropout its mask (m: bool on CUDA, 1; fp32 on CPU, 4) and the fp32 dropped
                                probabilities
        eager   p + c'          the softmax output in p bytes -- 4: transformers' eager attention (Llama, Qwen2)
                                and ours take the softmax in fp32, GPT-2's takes it in the compute dtype (fp32
                                only under autocast) -- and its cast back to the compute dtype (c' = c when
                                p != c, which the next matmul keeps); with dropout p + m + c (the mask, m: 1 on
                                CUDA, c on CPU, and the dropped probabilities; the cast is not kept)

    ``kernel``: ``attention_kernel``'s answer (None: asked here)."""
    kernel = kernel or attention_kernel(shape, device, precision if shape.hf else None)
    c, _, autocast = dtypes(precision)
    if kernel == "math":
        return 4 + ((1 if device == "cuda" else 4) + 4 if shape.dropout > 0 else 0)
    if kernel == "eager":
        p = c if shape.hf_arch == "gpt2" and not autocast else 4
        if shape.dropout > 0:
            return p + (1 if device == "cuda" else c) + c
        return p + (c if p != c else 0)
    return 0.0


def layer_bytes_per_token(shape: Shape, precision: str, *, device: str = "cuda", tp: int = 1,
                          sequence_parallel: bool = False) -> float:
    """Bytes one transformer layer saves for backward, per token (weight copies excluded)."""
    if shape.hf:
        return hf_layer_bytes_per_token(shape, precision, device=device, tp=tp, sequence_parallel=sequence_parallel)
    c, r, _ = dtypes(precision)
    h, a, m, s = shape.n_embd, shape.n_head, shape.mlp_ratio, shape.seq_len
    sp = tp if sequence_parallel else 1
    norms = (2 * r * h + 16) / sp
    # ln_1 / ln_2 outputs: inputs of the column-parallel linears (under autocast each of wq, wk, wv and fc keeps a
    # copy of its own: 2 c h more than this counts, measured; left so for full fine-tuning, whose published figures
    # use it -- LoRA's estimate counts them, ``lora_layer_bytes_per_token``)
    whole = 2 * c * h
    split = c * h * (4 + 2 * m)  # q, k, v, attention out, fc out, GELU out
    kernel = attention_kernel(shape, device)
    if kernel == "fused":
        split += 4 * a
    else:  # the s x s tensors; the math path keeps fp32 q, k, v (torch upcasts 16-bit inputs)
        split += scores_bytes(shape, precision, device=device, kernel=kernel) * a * s
        if kernel == "math":
            split += 3 * h * (4 - c)
    masks = 0.0
    if shape.dropout > 0:
        masks = 2 * h * (1 if device == "cuda" else c) / sp
    if shape.n_moe_layers:  # the average layer: MoE layers keep more than the dense MLP they replace
        split += shape.n_moe_layers / shape.n_layer * (moe_bytes_per_token(shape, precision) - 2 * c * m * h)
    return norms + whole + split / tp + masks + lora_layer_bytes_per_token(shape, precision, device=device, tp=tp)


def norm_bytes_per_token(shape: Shape, precision: str) -> float:
    """What one norm saves per token. LayerNorm: its input (the residual stream, dtype ``r``) and two
    fp32 statistics. RMSNorm as transformers writes it (``x.float()``, ``x * rsqrt(mean(x^2) + eps)``,
    ``weight * x.to(dtype)``): the fp32 input (the residual itself in fp32 and under autocast, a copy
    under bf16-true), the fp32 rsqrt and the normalised input in the parameters' dtype (kept for the weight's
    gradient: not with LoRA's frozen norms). LayerNorm's kernel keeps its input and statistics either way."""
    r = dtypes(precision)[1]
    h = shape.n_embd
    if shape.rms_norm and shape.lora is not None and shape.lora_units()["norms_frozen"]:
        return 4 * h + 4  # a frozen weight needs no normalised input for its gradient (LoRA)
    return 4 * h + 4 + r * h if shape.rms_norm else r * h + 8


def hf_layer_bytes_per_token(shape: Shape, precision: str, *, device: str = "cuda", tp: int = 1,
                             sequence_parallel: bool = False) -> float:
    """``layer_bytes_per_token`` of a Hugging Face decoder layer (``HF_ARCHS`` as ``models/hf/causal_lm.py``
    builds them: no dropout), from what its modules save (counted with ``saved_tensors_hooks``, to the
    byte, tests/test_activation_memory.py), per token (h hidden, a heads, kv = kv_heads x head_dim,
    F = mlp_hidden)::

        2 norm                  the two norms (``norm_bytes_per_token``)
        c h x n                 the norms' outputs as the column-parallel linears read them: one tensor
                                per norm (n = 2) in one dtype; under autocast every linear casts its
                                input itself and keeps that copy (n = 5: q, k, v, gate, up; GPT-2's
                                fused c_attn and its c_fc: 2)
        c (2 h + 2 kv)          q and the attention output (= o-proj input: the fused kernels return
                                a (B, T, H, D) layout, so its ``contiguous()`` copies nothing), k and v
                                at their own width (fused SDPA takes grouped-query k/v as they are)
        4 a                     logsumexp
        c F (act + 1 [+ 2])     the activation's saved input(s) (``ACT_SAVED``) and its output; a gated
                                MLP also keeps up's output and act(gate) * up (down's input)

    The math path (fp32 grouped-query attention on CUDA, ``sdpa_math``: ``attention_kernel``) keeps q, k and v
    repeated to h wide in fp32 (4 x 3 h: torch upcasts 16-bit inputs), the softmax output (``scores_bytes``
    a s) and a contiguous copy of the output (c h) instead; eager attention q, k and v (k, v repeated to h) and
    the output copy in the compute dtype (c 4 h) and its softmax output (``scores_bytes`` a s). RoPE keeps
    its cos/sin tables (per position, shared by every layer: left out). Tensor parallelism splits everything
    after the linears' inputs; the norms only with sequence parallelism."""
    c, _, autocast = dtypes(precision)
    h, a, s, kv, f = shape.n_embd, shape.n_head, shape.seq_len, shape.kv_width, shape.inner
    sp = tp if sequence_parallel else 1
    norms = 2 * norm_bytes_per_token(shape, precision) / sp
    whole = c * h * (shape.colwise_inputs if autocast else 2)
    mlp = c * f * (ACT_SAVED[shape.hidden_act] + (3 if shape.gated_mlp else 1))
    kernel = attention_kernel(shape, device, precision)
    if kernel == "fused":
        attention = c * (2 * h + 2 * kv) + 4 * a
    elif kernel == "math":
        attention = 4 * 3 * h + c * h + scores_bytes(shape, precision, device=device, kernel=kernel) * a * s
    else:
        attention = c * 4 * h + scores_bytes(shape, precision, device=device, kernel=kernel) * a * s
    return norms + whole + (attention + mlp) / tp + lora_layer_bytes_per_token(shape, precision, device=device, tp=tp)


def lora_layer_bytes_per_token(shape: Shape, precision: str, *, device: str = "cuda", tp: int = 1) -> float:
    """What LoRA (``shape.lora``, ``parallel/adapters/lora.py``) changes in what a block saves, per token (0 without
    it; measured with ``saved_tensors_hooks`` on our GPT and a Llama, fp32 and bf16-mixed, every target set and
    with dropout: tests/test_lora_costs.py). A frozen weight needs no input for its backward: ``x W^T``'s input
    gradient is ``g W``, so a frozen linear keeps its weight (a parameter; under autocast its bf16 copy, which
    ``weight_copy_bytes`` counts) but not its input. An adapted linear's ``lora_A`` keeps that input instead (the
    same tensor in one dtype; under autocast its own cast, as the base linear's was), and ``lora_B`` keeps ``A``'s
    output: ``c r`` per adapted linear. So per input a block's linears read (``counting.LINEAR_INPUTS``):

        attention / MLP input     under autocast each frozen linear's own copy is gone (c x in each); in one dtype
                                  the shared input is gone when every linear reading it is frozen
        attention output          kept anyway by fused SDPA (its backward reads its output); the math and eager
                                  paths' contiguous copy is gone with a frozen o-projection
        MLP inner activation      gone with a frozen down-projection (c F)

    With ``lora.dropout`` each adapted linear keeps the dropped input and its mask instead of the input itself
    (under autocast: its cast of the dropped input and the mask). The first block, the head and the embedding
    differ further where the embedding is frozen (``lora_model_bytes``)."""
    if shape.lora is None:
        return 0.0
    lo = shape.lora_units()
    c, r, autocast = dtypes(precision)
    kernel = attention_kernel(shape, device, precision if shape.hf else None)
    dropout = float(shape.lora.dropout)
    groups: dict[str, list[tuple[int, str]]] = {}
    for _, n_in, _, state, group in lo["linears"]:
        groups.setdefault(group, []).append((n_in, state))
    # our GPT's formula counts one copy of each norm's output under autocast; each linear keeps its own (measured)
    delta = (shape.colwise_inputs - 2) * c * shape.n_embd if autocast and not shape.hf else 0.0
    for group, members in groups.items():
        split = tp if group in ("attn_out", "mlp_out") else 1  # the row-parallel linears read a split input
        n_in = members[0][0] / split
        adapted = sum(1 for _, state in members if state == "adapted")
        frozen = sum(1 for _, state in members if state == "frozen")
        delta += adapted * c * lo["rank"]  # lora_B's input (A's output); whole under tp
        kept_anyway = group == "attn_out" and kernel == "fused"
        # the input's dtype: the norms' outputs are in the parameters' dtype (fp32 under autocast), the rest in c
        x_bytes = r if group in ("attn_in", "mlp_in") else c
        mask = n_in * (1 if device == "cuda" else x_bytes)
        if autocast and group in ("attn_in", "mlp_in"):
            delta -= c * n_in * frozen  # each linear casts (and keeps) its own copy: the frozen ones keep none
            if dropout:
                delta += adapted * mask  # A keeps its cast of the dropped input in place of the base's copy
        elif dropout and adapted:
            delta += adapted * (c * n_in + mask)  # the dropped input and its mask, per adapted linear
            if adapted + frozen == len(members) and not kept_anyway:
                delta -= c * n_in  # nothing reads the input itself for backward
        elif frozen == len(members) and not kept_anyway:
            delta -= c * n_in
    return delta


def lora_model_bytes(shape: Shape, precision: str, *, tp: int = 1, device: str = "cuda") -> tuple[float, float, float]:
    """Where LoRA's frozen embedding and head save less than full fine-tuning, as (per token of the first block,
    bytes of the first block, per token of the head): (0, 0, 0) without LoRA.

    With the embedding frozen its output needs no gradient, so the first block's first norm saves nothing (its
    input and statistics: ``norm_bytes``), and under autocast the first block's attention-input linears keep no
    copy of their base weights (nothing upstream needs the input gradient they would compute); the embedding
    saves nothing either (``embed_bytes_per_token`` is then 0); with ``lora.dropout`` the adapters of those linears
    keep no dropout mask (their input needs no gradient). A frozen output layer keeps no input (its final norm's
    output, c h per token; the chunked loss's checkpoint keeps it anyway). Not priced: target sets that leave every
    attention-input linear of the first block frozen, where nothing before the first adapter saves anything (the
    estimate is then high by up to one block's attention; tests/test_lora_costs.py)."""
    if shape.lora is None:
        return 0.0, 0.0, 0.0
    lo = shape.lora_units()
    c, r, autocast = dtypes(precision)
    first_tokens = first_fixed = 0.0
    if lo["embed_frozen"]:
        first_tokens = norm_bytes_per_token(shape, precision) if shape.rms_norm else r * shape.n_embd + 8
        if shape.lora.dropout:  # the masks of the attention-input adapters (their dropout's input needs no gradient)
            first_tokens += sum(n_in * (1 if device == "cuda" else r) for _, n_in, _, state, group in lo["linears"]
                                if group == "attn_in" and state == "adapted")
        if autocast:
            nf4 = shape.lora.base == "nf4"
            first_fixed = sum(n_in * n_out for _, n_in, n_out, state, group in lo["linears"]
                              if group == "attn_in" and not (nf4 and state == "adapted")) * 2 / tp
    head = c * shape.n_embd if lo["head_frozen"] and not shape.loss_chunk else 0.0
    return first_tokens, first_fixed, head


def selective_layer_bytes_per_token(shape: Shape, precision: str, *, device: str = "cuda") -> float:
    """Bytes one layer keeps per token under selective checkpointing (``parallel/memory/checkpointing.py``:
    matmul and fused-attention outputs saved, everything else recomputed): the block's input (the
    residual stream, in the parameters' dtype), every linear's output (``counting.block_linears``) in the
    compute dtype, and the attention core's -- the fused kernel's output and fp32 logsumexp, or the math
    path's two batched matmuls (the s x s scores and their product with v). Norms, activation functions,
    dropout and autocast's weight copies are recomputed, so they keep nothing. Eager attention is priced as the
    math path (its two matmuls' outputs; not measured in 16-bit, where the math path's are fp32). Not priced
    (ValueError): MoE layers (their expert matmuls) and tensor parallelism (a row-parallel linear keeps its
    full-width partial sum)."""
    if shape.n_moe_layers:
        raise ValueError("the estimator does not price selective checkpointing of MoE layers")
    c, r, _ = dtypes(precision)
    h, a, s = shape.n_embd, shape.n_head, shape.seq_len
    linears = sum(block_linears(shape).values())
    if attention_kernel(shape, device, precision if shape.hf else None) == "fused":
        core = c * h + 4 * a
    else:
        core = c * a * s + c * h
    if shape.lora is not None:  # an adapted linear's two more matmuls: A's output (r) and B's (the layer's width)
        lo = shape.lora_units()
        linears += sum(lo["rank"] + n_out for _, _, n_out, state, _ in lo["linears"] if state == "adapted")
    return r * h + c * linears + core


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
    """Final norm (``norm_bytes_per_token``), its output, the fp32 log-softmax output and the targets, per token.
    The chunked loss (``shape.loss_chunk``) keeps no logits: each chunk saves only its input (the norm's output)."""
    c = dtypes(precision)[0]
    logits = 0.0 if shape.loss_chunk else 4 * shape.vocab_size / (tp if loss_parallel else 1)
    frozen_head = lora_model_bytes(shape, precision, tp=tp)[2]  # LoRA: a frozen output layer keeps no input
    return norm_bytes_per_token(shape, precision) + c * shape.n_embd - frozen_head + logits + 8


def loss_transient_bytes(shape: Shape, tokens: float, *, tp: int = 1, loss_parallel: bool = False) -> float:
    """What the loss's backward adds: two fp32 B x T x V gradients (the log-softmax output is ``head_bytes``');
    chunked, one chunk's recomputed log-softmax output and its two gradients, 12 V per token of the chunk,
    the vocabulary split over tp (the chunked loss is vocabulary-parallel under tensor parallelism)."""
    if shape.loss_chunk:
        return 12 * shape.vocab_size / tp * min(shape.loss_chunk, tokens)
    return 8 * shape.vocab_size / (tp if loss_parallel else 1) * tokens


def embed_bytes_per_token(shape: Shape, precision: str, device: str = "cuda") -> float:
    """The token ids (int64) and, with dropout, its mask; nothing for a frozen embedding (LoRA)."""
    if shape.lora is not None and shape.lora_units()["embed_frozen"]:
        return 0.0
    c = dtypes(precision)[0]
    return 8 + (shape.n_embd * (1 if device == "cuda" else c) if shape.dropout > 0 else 0)


def checkpoint_bytes_per_token(shape: Shape, precision: str, tp: int = 1, sequence_parallel: bool = False) -> float:
    """A checkpointed block keeps only its input: the residual stream, in the parameters' dtype."""
    return dtypes(precision)[1] * shape.n_embd / (tp if sequence_parallel else 1)


def layer_backward_transient_per_token(shape: Shape, precision: str, tp: int = 1) -> float:
    """Gradients alive inside one block's backward: the MLP's inner gradient pair (fc out, GELU out);
    a gated MLP's three (of act(gate) * up, then of act(gate) and of up)."""
    c = dtypes(precision)[0]
    if shape.hf:
        return (3 if shape.gated_mlp else 2) * c * shape.inner / tp
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
