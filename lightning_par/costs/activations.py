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

Hugging Face decoders (``models/hf.py``: Llama, Qwen2 and GPT-2 as ``hf_config`` builds them; a
``Shape`` with ``hf_arch``) save what their own modules save, counted the same way
(``hf_layer_bytes_per_token``): RMSNorm's fp32 statistics, one autocast copy of a norm's output per
linear that reads it, grouped-query k/v at their own width, a gated MLP's four inner tensors.
Their parameters are counted from the transformers model itself (``Shape.units``), built from the
config's sizes and every further field that differs from the architecture's defaults (``hf_extra``:
biases, rotary parameters, ...), so the count is transformers' own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from lightning_par import dtypes as _dtypes
from lightning_par.costs.states import PRECISIONS, check

#: transformers architectures whose layers ``hf_layer_bytes_per_token`` describes (measured op by op);
#: others (Gemma's extra norms and soft-capping, MoE families) are traced instead (``costs/traced.py``)
HF_ARCHS = ("llama", "qwen2", "gpt2")
#: tensors of the MLP's inner width an activation function saves for its backward, besides its output
#: (which the next op saves): torch's fused GELU / SiLU their input; transformers' ``gelu_new`` is
#: written out in Python ops (0.5 x (1 + tanh(c (x + 0.044715 x^3)))) and keeps four
ACT_SAVED = {"gelu": 1, "gelu_pytorch_tanh": 1, "silu": 1, "gelu_new": 4}
#: transformers config fields a ``Shape`` holds in its own fields (``models/hf.py``'s size vocabulary:
#: ``hf_config``'s arguments), by architecture family
_HF_SIZE_FIELDS = {
    "gpt2": ("n_embd", "n_layer", "n_head", "n_inner", "n_positions", "vocab_size", "tie_word_embeddings",
             "activation_function"),
    "": ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "intermediate_size", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "hidden_act"),
}
#: fields that do not change the model trained here: token ids (the data's own; ``hf_config`` sets
#: none), the KV cache, dropout (off in every run), the per-layer attention kinds (derived from the
#: depth; ``of_hf`` refuses any but full attention)
_HF_IGNORED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "layer_types", "resid_pdrop",
                      "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout", "summary_first_dropout",
                      "dropout", "activation_dropout")


def hf_extra_fields(config: Any) -> tuple[tuple[str, str], ...]:
    """The fields of a transformers config that a ``Shape``'s sizes do not say and that differ from
    the architecture's defaults (``attention_bias``, ``mlp_bias``, ``rope_parameters``,
    ``rms_norm_eps``, ...), as (name, JSON value) pairs, sorted: the config's class fields only
    (not ``PretrainedConfig``'s bookkeeping: architectures, dtype, ...)."""
    from transformers import PretrainedConfig

    base = set(PretrainedConfig().to_dict())
    default = type(config)().to_dict()
    mine = config.to_dict()
    skip = set(_HF_SIZE_FIELDS["gpt2" if config.model_type == "gpt2" else ""]) | set(_HF_IGNORED_FIELDS) | base
    return tuple(sorted((k, json.dumps(v, sort_keys=True, default=str)) for k, v in mine.items()
                        if k in default and k not in skip and not k.startswith("_") and v != default[k]))


@dataclass(frozen=True)
class Shape:
    """A decoder's shape and the sequence length it trains on: our GPT / MoE (fields as in
    ``GPTConfig``) or, with ``hf_arch``, a Hugging Face decoder as ``models/hf.py`` builds it. For
    those ``mlp_ratio`` and ``dropout`` are not used (``mlp_hidden`` says the MLP's size; dropout is
    off) and ``bias`` says whether the norms have one (linear biases, e.g. Qwen2's q/k/v, are in the
    parameter counts, which come from the model)."""

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
    # what Hugging Face decoders add (defaults: our GPT's layout)
    kv_heads: int = 0  # key/value heads of grouped-query attention (0: n_head)
    mlp_hidden: int = 0  # the MLP's inner size (0: mlp_ratio * n_embd)
    gated_mlp: bool = False  # down(act(gate(x)) * up(x)) (Llama's SwiGLU) instead of proj(act(fc(x)))
    hidden_act: str = "gelu"  # the MLP's activation, by transformers' name (``ACT_SAVED``)
    fused_qkv: bool = False  # one linear computes q, k and v (GPT-2's c_attn)
    rms_norm: bool = False  # RMSNorm (a weight, fp32 statistics) instead of LayerNorm
    tied: bool = False  # the output head reuses the token embedding's table
    learned_positions: bool = True  # a position table of block_size rows (False: rotary, no table)
    hf_arch: str = ""  # the transformers model_type (``HF_ARCHS``); "": models/gpt.py / moe.py
    #: further transformers config fields, (name, JSON value), that differ from the architecture's
    #: defaults (``hf_extra_fields``: attention / MLP biases, rotary parameters, norm epsilon, ...)
    hf_extra: tuple[tuple[str, str], ...] = ()

    @property
    def hf(self) -> bool:
        """A Hugging Face decoder (``models/hf.py``), not our GPT / MoE."""
        return bool(self.hf_arch)

    @property
    def hf_fields(self) -> dict[str, Any]:
        """``hf_extra`` as config fields (the values decoded)."""
        return {k: json.loads(v) for k, v in self.hf_extra}

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.n_head

    @property
    def kv_width(self) -> int:
        """Features of k (and of v): key/value heads x head_dim."""
        return self.n_kv_heads * (self.n_embd // self.n_head)

    @property
    def inner(self) -> int:
        """The dense MLP's inner size."""
        return self.mlp_hidden or self.mlp_ratio * self.n_embd

    @property
    def colwise_inputs(self) -> int:
        """Column-parallel linears of a layer that read a norm's output: q, k, v (GPT-2: its fused
        c_attn) and fc (gated: gate and up). Each keeps its own autocast copy of that input, and under
        tensor parallelism each all-reduces its input gradient in backward."""
        return (1 if self.fused_qkv else 3) + (2 if self.gated_mlp else 1)

    @property
    def n_moe_layers(self) -> int:
        """Blocks whose MLP is a routed MoE layer (block i when (i + 1) % moe_every == 0)."""
        return self.n_layer // self.moe_every if self.n_experts else 0

    @property
    def moe_hidden(self) -> int:
        return self.expert_hidden or self.mlp_ratio * self.n_embd

    @classmethod
    def of(cls, config, seq_len: int | None = None) -> Shape:
        """From a ``GPTConfig`` (or anything with its fields), or a transformers config (``of_hf``);
        ``seq_len`` defaults to ``block_size``."""
        if hasattr(config, "model_type"):
            return cls.of_hf(config, seq_len)
        n_experts = int(getattr(config, "n_experts", 0) or 0)
        moe = dict(n_experts=n_experts, top_k=int(config.top_k), moe_every=int(config.moe_every),
                   expert_hidden=int(config.expert_hidden or 0), shared_expert=bool(config.shared_expert)) \
            if n_experts else {}
        return cls(config.n_layer, config.n_embd, config.n_head, config.vocab_size,
                   int(seq_len or getattr(config, "seq_len", None) or config.block_size),
                   getattr(config, "mlp_ratio", 4), float(getattr(config, "dropout", 0.0)), getattr(config, "bias", True),
                   getattr(config, "block_size", None), **moe)

    @classmethod
    def of_hf(cls, config: Any, seq_len: int | None = None) -> Shape:
        """From the transformers config ``models/hf.py`` builds (``HFCausalLM.hf_config``: no dropout,
        head_dim = hidden / heads); ``seq_len`` defaults to its longest sequence. ValueError for an
        architecture whose layers this module does not describe (``HF_ARCHS``)."""
        arch = str(config.model_type)
        if arch not in HF_ARCHS:
            raise ValueError(f"the estimator has no op-by-op shape for a {arch!r} model (only "
                             f"{', '.join(HF_ARCHS)}); mode=estimate traces any model (costs/traced.py)")
        gpt2 = arch == "gpt2"
        hidden = int(config.n_embd if gpt2 else config.hidden_size)
        heads = int(config.n_head if gpt2 else config.num_attention_heads)
        if not gpt2 and int(getattr(config, "head_dim", None) or hidden // heads) * heads != hidden:
            raise ValueError(f"{arch}: head_dim x heads != hidden ({config.head_dim} x {heads} != {hidden}); the "
                             "estimator assumes models/hf.py's head_dim = hidden / heads")
        act = str(config.activation_function if gpt2 else config.hidden_act)
        if act not in ACT_SAVED:
            raise ValueError(f"{arch}: the estimator does not know what activation {act!r} saves "
                             f"(known: {', '.join(ACT_SAVED)})")
        positions = int(config.n_positions if gpt2 else config.max_position_embeddings)
        inner = int((config.n_inner if gpt2 else config.intermediate_size) or 4 * hidden)
        kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention"}
        if kinds:
            raise ValueError(f"{arch}: layers of {', '.join(sorted(kinds))} (sliding-window attention): the estimator "
                             "models full causal attention only")
        return cls(int(config.n_layer if gpt2 else config.num_hidden_layers), hidden, heads, int(config.vocab_size),
                   int(seq_len or positions), bias=gpt2, block_size=positions,
                   kv_heads=0 if gpt2 else int(config.num_key_value_heads or heads), mlp_hidden=inner,
                   gated_mlp=not gpt2, hidden_act=act, fused_qkv=gpt2, rms_norm=not gpt2,
                   tied=bool(config.tie_word_embeddings), learned_positions=gpt2, hf_arch=arch,
                   hf_extra=hf_extra_fields(config))

    def hf_config(self, layers: int | None = None) -> Any:
        """The transformers config of a Hugging Face shape, built by ``models/hf.py``'s ``hf_config``
        with its further fields (``hf_extra``; ``layers``: another depth, e.g. one layer to count a
        layer's parameters)."""
        if not self.hf:
            raise ValueError("hf_config: not a Hugging Face shape (hf_arch is empty); see gpt_config")
        from lightning_par.models.hf import hf_config

        act = {"activation_function" if self.hf_arch == "gpt2" else "hidden_act": self.hidden_act}
        return hf_config(self.hf_arch, hidden=self.n_embd, layers=layers or self.n_layer, heads=self.n_head,
                         kv_heads=self.kv_heads or None, intermediate=self.inner, vocab=self.vocab_size,
                         max_positions=self.block_size or self.seq_len, tie_word_embeddings=self.tied,
                         **act, **self.hf_fields)

    def gpt_config(self, dense: bool = False):
        """The model's config: a ``GPTConfig``, or a ``MoEConfig`` for an MoE shape (``dense``: the
        GPT of the same dimensions, whose blocks are the MoE model's dense blocks)."""
        if self.hf:
            raise ValueError(f"gpt_config: a Hugging Face {self.hf_arch} shape builds no GPT; see hf_config")
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
        expert); ``block`` stays a dense block. Hugging Face shapes add ``tied``: the elements the
        head shares with the embedding (0 untied), in both ``embed`` and ``head`` (a pipeline's
        first and last stages each hold a copy) and once in ``total``."""
        return dict(_hf_unit_params(self) if self.hf else _unit_params(self))


#: the modules ``strategy.tiling`` names, in our GPT (``GPTModule.net``; Hugging Face: ``module_paths``)
GPT_PATHS = {"blocks": "net.blocks", "head": "net.head.lm_head", "embed": "net.embed.tok"}


def module_paths(shape: Shape) -> dict[str, str]:
    """Paths in the LightningModule (as ``strategy.tiling`` names modules) of the decoder layers'
    list (``blocks``: layer ``i`` is ``<blocks>.i``), the output head and the token embedding."""
    return dict(_hf_layout(shape)[0]) if shape.hf else dict(GPT_PATHS)


def block_linears(shape: Shape) -> dict[str, int]:
    """A block's matmul layers (path inside the block) and their output features -- what a tile count
    must divide (``parallel/tiling.py``: nn.Linear rows, transformers' Conv1D columns)."""
    return dict(_hf_layout(shape)[1]) if shape.hf else dict(_gpt_linears(shape))


def tiled_part(shape: Shape, path: str) -> str | None:
    """What a ``strategy.tiling`` path names: ``"head"``, ``"embed"``, a block's matmul as its
    ``units`` key (``block.<path in the block>``), or None."""
    p = {k: v.removeprefix("net.") for k, v in module_paths(shape).items()}
    dotted, blocks = f".{path}", f".{p['blocks']}."
    if dotted.endswith(f".{p['head']}"):
        return "head"
    if dotted.endswith(f".{p['embed']}"):
        return "embed"
    if blocks in dotted:
        return "block." + dotted.split(blocks, 1)[1].split(".", 1)[1]
    return None


def _matmuls(module: Any) -> dict[str, Any]:
    """The ``nn.Linear`` and transformers ``Conv1D`` (GPT-2's: ``x @ W + b`` with ``W`` (in, out),
    recognised by name as ``parallel/tiling.py`` does) layers of ``module`` by path."""
    from torch import nn

    return {name: m for name, m in module.named_modules()
            if isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D" and hasattr(m, "nf"))}


@lru_cache(maxsize=64)
def _gpt_linears(shape: Shape) -> tuple[tuple[str, int], ...]:
    import torch

    from lightning_par.models.gpt import Block

    with torch.device("meta"):
        block = Block(shape.gpt_config(dense=True))
    return tuple((name, m.out_features) for name, m in _matmuls(block).items())


@lru_cache(maxsize=16)
def hf_model(shape: Shape) -> Any:
    """The Hugging Face model of ``shape`` with one decoder layer, on the meta device: every layer has
    the same parameters, so one is all the counts need."""
    import torch

    from lightning_par.models.hf import _transformers

    config = shape.hf_config(layers=1)
    with torch.device("meta"):
        return _transformers().AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)


@lru_cache(maxsize=16)
def hf_plan(shape: Shape) -> Any:
    """The ``ParallelPlan`` the Hugging Face model of ``shape`` declares (``parallel/hf_plan.py``:
    its tensor-parallel plan and the sizes tp must divide, its pipeline cut points, refusals) -- what
    the strategies will use, so what the advisor may propose. Its paths are the one-layer model's."""
    from lightning_par.parallel.hf_plan import hf_parallel_plan

    return hf_parallel_plan(hf_model(shape))


@lru_cache(maxsize=16)
def _hf_layout(shape: Shape) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, int], ...]]:
    from lightning_par.parallel.hf_plan import hf_blocks

    net = hf_model(shape)
    (block,) = hf_blocks(net)  # "model.layers.0"
    where = {id(m): name for name, m in net.named_modules()}
    paths = {"blocks": "net." + block.rsplit(".", 1)[0], "head": "net." + where[id(net.get_output_embeddings())],
             "embed": "net." + where[id(net.get_input_embeddings())]}
    linears = {name: (m.out_features if hasattr(m, "out_features") else m.nf)
               for name, m in _matmuls(net.get_submodule(block)).items()}
    return tuple(paths.items()), tuple(linears.items())


@lru_cache(maxsize=16)
def _hf_unit_params(shape: Shape) -> tuple[tuple[str, int], ...]:
    """``units`` of a Hugging Face shape, from the transformers model with one layer: ``embed`` is
    what its pipeline plan places before the decoder layers (token table, GPT-2's position table),
    ``head`` what it places after them (final norm, output head), each counted whole."""
    from lightning_par.parallel.hf_plan import _matches, hf_blocks, hf_layers  # _matches: the plans' "*" rule

    net = hf_model(shape)
    (block_path,) = hf_blocks(net)
    block = net.get_submodule(block_path)
    layers = hf_layers(net)  # in forward order: embeddings, the layer, final norm, head
    at = layers.index(block_path)

    def params(paths: tuple[str, ...]) -> dict[int, Any]:
        return {id(p): p for path in paths for p in net.get_submodule(path).parameters()}

    embed, head = params(layers[:at]), params(layers[at + 1:])
    count = lambda ps: sum(p.numel() for p in ps.values())  # noqa: E731
    tied = sum(p.numel() for k, p in head.items() if k in embed)
    units = {f"block.{name}": m.weight.numel() for name, m in _matmuls(block).items()}
    matmuls = [units[k] for k in units]
    units |= {"embed": count(embed), "block": sum(p.numel() for p in block.parameters()), "head": count(head),
              "lm_head": net.get_output_embeddings().weight.numel(),
              "embed_table": net.get_input_embeddings().weight.numel(),
              "block_matmul": sum(matmuls), "block_linear": max(matmuls), "tied": tied}
    units["total"] = units["embed"] + shape.n_layer * units["block"] + units["head"] - tied
    every = {id(p) for p in net.parameters()}
    assert every == set(embed) | set(head) | {id(p) for p in block.parameters()}, "a parameter outside the plan's parts"
    # what tensor parallelism splits, by the model's own plan as hf_plan translates it (colwise, packed,
    # vocabulary splits: every parameter of the module; rowwise: the weight, its bias replicated)
    plan = hf_plan(shape).tp_plan
    for part, paths in (("embed", layers[:at]), ("block", (block_path,)), ("head", layers[at + 1:])):
        split, tensors = 0, set()
        for path in paths:
            for name, m in net.get_submodule(path).named_modules():
                full = f"{path}.{name}" if name else path
                style = next((v for k, v in plan.items() if _matches(k, full)), "")
                own = list(m.parameters(recurse=False))
                if style.split(":")[0] in ("colwise", "packed_colwise", "embedding", "output"):
                    split += sum(p.numel() for p in own)
                elif style == "rowwise":
                    split += m.weight.numel()
            tensors |= {id(p) for p in net.get_submodule(path).parameters()}
        units[f"{part}_tp_split"] = split
        units[f"{part}_tensors"] = len(tensors)
    return tuple(units.items())


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


def attention_kernel(shape: Shape, device: str = "cuda", precision: str | None = None) -> str:
    """``fused`` (flash or memory-efficient SDPA: O(s) saved state) or ``math`` (s x s scores).

    CUDA: flash (fp16/bf16) or memory-efficient (fp32, head_dim <= 256) kernels take the causal mask
    and dropout. CPU (torch 2.13): ``_scaled_dot_product_flash_attention_for_cpu`` runs for fp32 and
    bf16 without dropout; with dropout SDPA falls back to the math path. Grouped-query attention
    (transformers passes ``enable_gqa``): the CPU flash kernel and CUDA's flash kernel take k/v at their
    own width, CUDA's memory-efficient kernel does not, so fp32 compute on CUDA (``precision``) runs
    the math path -- torch's dispatch rule, not measured here (no GPU)."""
    head_dim = shape.n_embd // shape.n_head
    if device == "cpu":
        return "math" if shape.dropout > 0 else "fused"
    if shape.n_kv_heads != shape.n_head and precision is not None and dtypes(precision)[0] == 4:
        return "math"
    return "fused" if head_dim <= 256 else "math"


def layer_bytes_per_token(shape: Shape, precision: str, *, device: str = "cuda", tp: int = 1,
                          sequence_parallel: bool = False, selective: bool = False) -> float:
    """Bytes one transformer layer saves for backward, per token (weight copies excluded).
    ``selective``: Korthikanti et al.'s selective recomputation -- the attention core (softmax,
    dropout, scores) is recomputed, so the math path's s x s tensors are not kept (the fused kernels
    keep none anyway)."""
    if shape.hf:
        return hf_layer_bytes_per_token(shape, precision, device=device, tp=tp, sequence_parallel=sequence_parallel,
                                        selective=selective)
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


def norm_bytes_per_token(shape: Shape, precision: str) -> float:
    """What one norm saves per token. LayerNorm: its input (the residual stream, dtype ``r``) and two
    fp32 statistics. RMSNorm as transformers writes it (``x.float()``, ``x * rsqrt(mean(x^2) + eps)``,
    ``weight * x.to(dtype)``): the fp32 input (the residual itself in fp32 and under autocast, a copy
    under bf16-true), the fp32 rsqrt and the normalised input in the parameters' dtype."""
    r = dtypes(precision)[1]
    h = shape.n_embd
    return 4 * h + 4 + r * h if shape.rms_norm else r * h + 8


def hf_layer_bytes_per_token(shape: Shape, precision: str, *, device: str = "cuda", tp: int = 1,
                             sequence_parallel: bool = False, selective: bool = False) -> float:
    """``layer_bytes_per_token`` of a Hugging Face decoder layer (``HF_ARCHS`` as ``models/hf.py``
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

    The math path (fp32 grouped-query attention on CUDA, ``attention_kernel``) keeps q, k and v
    repeated to h wide, the softmax output (c a s, no dropout) and a contiguous copy of the output
    instead. RoPE keeps its cos/sin tables (per position, shared by every layer: left out). Tensor
    parallelism splits everything after the linears' inputs; the norms only with sequence parallelism."""
    c, _, autocast = dtypes(precision)
    h, a, s, kv, f = shape.n_embd, shape.n_head, shape.seq_len, shape.kv_width, shape.inner
    sp = tp if sequence_parallel else 1
    norms = 2 * norm_bytes_per_token(shape, precision) / sp
    whole = c * h * (shape.colwise_inputs if autocast else 2)
    mlp = c * f * (ACT_SAVED[shape.hidden_act] + (3 if shape.gated_mlp else 1))
    if attention_kernel(shape, device, precision) == "fused":
        attention = c * (2 * h + 2 * kv) + 4 * a
    else:
        attention = c * 4 * h + (0 if selective else c * a * s)
    return norms + whole + (attention + mlp) / tp


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
    """Final norm (``norm_bytes_per_token``), its output, the fp32 log-softmax output and the targets, per token."""
    c = dtypes(precision)[0]
    v = shape.vocab_size / (tp if loss_parallel else 1)
    return norm_bytes_per_token(shape, precision) + c * shape.n_embd + 4 * v + 8


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
