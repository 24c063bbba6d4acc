"""Tensor-parallel plans for Hugging Face families that declare none but whose layout is standard.

transformers declares no ``base_model_tp_plan`` for GPT-2, OPT, Falcon, BERT, RoBERTa, T5, BART or ViT,
yet each is Megatron-LM's layout: attention projections split by heads then a row-split output
projection, a two-linear MLP, and (language models) a vocabulary-split embedding tied to the LM head.
A derivation here writes that plan in our style names (``tp_styles.STYLES``) for one family -- the
base model's entries, prefixed by ``base_model_prefix`` where a head class holds the base model under
it, and the heads' entries, kept where the model has that head -- and checks, on the built model, the
facts the plan relies on (each split module's class and its width: whole heads per rank); a model
that breaks one is refused in one line. A derived plan then meets the same gate as a declared one:
the family must be verified (``hf.tp_verified``), which ``tests/test_hf_tp_registry.py`` (causal-LM
heads) and ``tests/test_encoder_tp.py`` (BERT/RoBERTa masked LM, T5/BART seq2seq, ViT classification)
measure: parity at tp=2 with the unsplit model. Nothing here imports transformers.

Every entry left out is replicated (``tensor_parallel.apply_tensor_parallel``'s ``replicate_rest``):
norms, position tables, poolers and classifiers run whole on the replicated hidden states, which is
exact. Attention forwards here view their projections as ``(B, T, -1, head_dim)``, so a column split
of q/k/v is a split of the heads; the head counts they keep (``num_heads``, ...) are divided by tp
(``divide_attrs``) so that what reads them (T5's zero position bias) sees this rank's heads.

- GPT-2: ``Conv1D`` stores its weight ``(in, out)``; ``c_attn`` is ``q|k|v`` packed along the output
  features, so it is ``packed_colwise:3`` (each rank its heads of each of q, k, v), and the attention
  splits the fused output by ``split_size`` (the hidden size), which becomes hidden / tp
  (``divide_attrs``); ``c_proj`` rowwise; ``mlp.c_fc`` colwise, ``mlp.c_proj`` rowwise; ``wte`` split
  by vocabulary rows and the tied ``lm_head`` alike, so the tie holds (``tensor_parallel._retie_split``).
- OPT: q/k/v colwise, ``out_proj`` rowwise, ``fc1`` colwise, ``fc2`` rowwise; its attention views
  ``(B, T, num_heads, head_dim)``, so ``num_heads`` becomes heads / tp; embedding and tied head as GPT-2.
- BERT, RoBERTa: ``query``/``key``/``value`` colwise, ``attention.output.dense`` rowwise,
  ``intermediate.dense`` colwise, ``output.dense`` rowwise (a decoder's ``crossattention`` alike);
  ``word_embeddings`` by vocabulary rows. The MLM head's transform (``dense`` + LayerNorm, hidden to
  hidden) stays replicated; its ``decoder`` is the vocabulary-split output layer, its weight tied to
  the word embeddings and its bias tied to the head's own ``bias`` (``cls.predictions.bias``,
  ``lm_head.bias``): that parameter is split by vocabulary too (a parameter entry), so both ties stay
  one ``Shard(0)`` DTensor each. Position and token-type tables replicated.
- T5: ``q``/``k``/``v`` colwise, ``o`` rowwise (self- and cross-attention), ``wi`` (or the gated
  ``wi_0``, ``wi_1``) colwise, ``wo`` rowwise. ``relative_attention_bias`` is an embedding of
  (buckets, heads) whose output is added to the scores of every layer of its stack, so it is split
  by heads (columns, output left on this rank's heads): each rank keeps the bias of the heads it
  computes. ``n_heads``/``inner_dim`` divided (the cross-attention's zero bias is sized by them).
  One table for encoder, decoder and LM head (``shared``, ``encoder/decoder.embed_tokens``,
  ``lm_head``): all four uses split by vocabulary rows and re-tied to one DTensor; the v1.0 head's
  ``d_model**-0.5`` scaling is applied to the replicated hidden states before it, unchanged.
- BART: q/k/v colwise, ``out_proj`` rowwise (encoder, decoder and ``encoder_attn``), ``fc1``
  colwise, ``fc2`` rowwise, ``num_heads`` divided; ``shared`` and both stacks' ``embed_tokens``
  (scaled embeddings: the scale multiplies the partial lookups, exact) and the tied ``lm_head`` by
  vocabulary; the learned position tables run replicated on local tensors (their positions come as
  a keyword argument, as OPT's); ``final_logits_bias`` (a buffer) is added to the gathered logits.
- ViT: q/k/v colwise, ``o_proj`` rowwise, ``fc1`` colwise, ``fc2`` rowwise; the embeddings module's
  own ``cls_token``, ``position_embeddings`` and ``mask_token`` (parameters, not modules) replicated
  and used as local tensors, its patch convolution replicated; the classifier reads the replicated
  CLS row, replicated.
- Falcon: ``query_key_value`` fuses q, k and v, in one of three layouts chosen by its config (read
  in ``FalconAttention._split_heads``), each of which a plain column split cuts at whole heads:
  ``new_decoder_architecture`` packs per key/value group (that group's queries, then its k, then its
  v), so contiguous rows are whole groups when tp divides ``num_kv_heads``; the original layout
  without ``multi_query`` interleaves (q, k, v) per head, whole heads when tp divides the heads;
  ``multi_query`` puts every query first and one k and one v shared by all of them after, which no
  split keeps whole -- its one key/value head is a size tp must divide (tp=1), the same rule as any
  grouped-query model's. The forward views the fused output by ``num_heads`` and ``num_kv_heads``
  (divided), ``dense`` rowwise, the MLP's ``dense_h_to_4h`` colwise and ``dense_4h_to_h`` rowwise,
  the word table and the tied head by vocabulary. ``alibi=True`` is refused in one line:
  ``FalconModel.forward`` builds the ALiBi biases of all heads and each attention views them by its
  local head count, so a split one would add other heads' slopes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import DTensor

#: the width an ``expect`` entry's attribute must have, from the config (None: only present)
Width = Callable[[object], int] | None


@dataclass(frozen=True)
class Derivation:
    base: dict[str, str]  #: base-model pattern -> our style name (``base_model_prefix`` put in front)
    #: pattern -> (class name or None, attribute or None, its width from the config or None) the plan relies
    #: on; a base pattern is prefixed like ``base``
    expect: dict[str, tuple[str | None, str | None, Width]]
    divisible: Callable[[object], dict[str, int]]  #: sizes tp must divide, from the config
    #: whole-model pattern -> style: a head's modules (an LM head, a tied MLM decoder), kept where present
    head: dict[str, str] = field(default_factory=dict)
    #: base patterns a config may not build (a gated MLP's inputs, a cross-attention, block 0's position bias)
    optional: frozenset[str] = frozenset()
    #: base pattern -> base path: the pattern is required only where the model has that path (a stack some
    #: head classes lack: T5EncoderModel's decoder, BartForCausalLM's encoder)
    needs: dict[str, str] = field(default_factory=dict)
    cross_attention: bool = False  #: the plan covers ``add_cross_attention``'s layers
    #: config -> why this configuration cannot be split (one line), or None
    refuse: Callable[[object], str | None] | None = None


def _hidden(cfg: object) -> int:
    return cfg.hidden_size


def _gpt2_sizes(cfg: object) -> dict[str, int]:
    hidden = cfg.n_embd
    return {"attention heads": cfg.n_head, "MLP size": cfg.n_inner or 4 * hidden, "vocab_size": cfg.vocab_size}


def _opt_sizes(cfg: object) -> dict[str, int]:
    return {"attention heads": cfg.num_attention_heads, "MLP size": cfg.ffn_dim, "vocab_size": cfg.vocab_size}


def _bert_sizes(cfg: object) -> dict[str, int]:
    return {"attention heads": cfg.num_attention_heads, "MLP size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size}


def _t5_sizes(cfg: object) -> dict[str, int]:
    return {"attention heads": cfg.num_heads, "MLP size": cfg.d_ff, "vocab_size": cfg.vocab_size}


def _bart_sizes(cfg: object) -> dict[str, int]:
    return {"encoder attention heads": cfg.encoder_attention_heads,
            "decoder attention heads": cfg.decoder_attention_heads, "encoder MLP size": cfg.encoder_ffn_dim,
            "decoder MLP size": cfg.decoder_ffn_dim, "vocab_size": cfg.vocab_size}


def _vit_sizes(cfg: object) -> dict[str, int]:
    return {"attention heads": cfg.num_attention_heads, "MLP size": cfg.intermediate_size}


def _falcon_qkv_width(cfg: object) -> int:
    """``query_key_value``'s output features in each of Falcon's three layouts."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    if cfg.new_decoder_architecture:
        return (cfg.num_attention_heads + 2 * cfg.num_kv_heads) * head_dim
    return cfg.hidden_size + 2 * head_dim if cfg.multi_query else 3 * cfg.hidden_size


def _falcon_sizes(cfg: object) -> dict[str, int]:
    if cfg.new_decoder_architecture:
        kv = cfg.num_kv_heads  # the fused rows are whole key/value groups
    else:
        kv = 1 if cfg.multi_query else cfg.num_attention_heads  # one shared k/v, or (q, k, v) per head
    return {"attention heads": cfg.num_attention_heads, "key/value heads": kv,
            "MLP size": cfg.ffn_hidden_size or 4 * cfg.hidden_size, "vocab_size": cfg.vocab_size}


def _falcon_refuse(cfg: object) -> str | None:
    if getattr(cfg, "alibi", False):
        return ("alibi=True: FalconModel.forward builds the ALiBi biases of all heads and each attention views "
                "them by its own head count, so a rank holding some heads would add other heads' slopes; no "
                "tensor-parallel plan is derived for it (use fsdp or zero3)")
    return None


def _bert_like(head: dict[str, str]) -> Derivation:
    """BERT and RoBERTa (the same encoder; their MLM heads differ in names only)."""
    layer = "encoder.layer.*"
    base = {"embeddings.word_embeddings": "embedding"}
    expect: dict[str, tuple[str | None, str | None, Width]] = {"embeddings.word_embeddings": ("Embedding", None, None)}
    optional = set()
    for attn in ("attention", "crossattention"):
        for proj in ("query", "key", "value"):
            base[f"{layer}.{attn}.self.{proj}"] = "colwise"
            expect[f"{layer}.{attn}.self.{proj}"] = ("Linear", "out_features", _hidden)
        base[f"{layer}.{attn}.self"] = "divide_attrs:num_attention_heads,all_head_size"
        expect[f"{layer}.{attn}.self"] = (None, "all_head_size", _hidden)
        base[f"{layer}.{attn}.output.dense"] = "rowwise"
        expect[f"{layer}.{attn}.output.dense"] = ("Linear", "in_features", _hidden)
    optional.update(p for p in base if ".crossattention." in p)
    base.update({f"{layer}.intermediate.dense": "colwise", f"{layer}.output.dense": "rowwise"})
    expect.update({f"{layer}.intermediate.dense": ("Linear", None, None),
                   f"{layer}.output.dense": ("Linear", None, None)})
    for pattern, style in head.items():
        if style == "output":
            expect[pattern] = ("Linear", None, None)
    return Derivation(base=base, expect=expect, divisible=_bert_sizes, head=head, optional=frozenset(optional),
                      cross_attention=True)


def _t5() -> Derivation:
    base = {"shared": "embedding", "encoder.embed_tokens": "embedding", "decoder.embed_tokens": "embedding"}
    inner = lambda cfg: cfg.num_heads * cfg.d_kv  # noqa: E731
    expect: dict[str, tuple[str | None, str | None, Width]] = {
        "shared": ("Embedding", None, None), "encoder.embed_tokens": ("Embedding", None, None),
        "decoder.embed_tokens": ("Embedding", None, None)}
    optional = {"shared"}
    for stack, attns, ff in (("encoder", (("0", "SelfAttention"),), "1"),
                             ("decoder", (("0", "SelfAttention"), ("1", "EncDecAttention")), "2")):
        for i, name in attns:
            attn = f"{stack}.block.*.layer.{i}.{name}"
            for proj in ("q", "k", "v"):
                base[f"{attn}.{proj}"] = "colwise"
                expect[f"{attn}.{proj}"] = ("Linear", "out_features", inner)
            base[f"{attn}.o"] = "rowwise"
            expect[f"{attn}.o"] = ("Linear", "in_features", inner)
            base[attn] = "divide_attrs:n_heads,inner_dim"
            expect[attn] = (None, "inner_dim", inner)
            # (buckets, heads): split by heads, this rank's columns are the bias of its own heads
            base[f"{attn}.relative_attention_bias"] = "colwise"
            expect[f"{attn}.relative_attention_bias"] = ("Embedding", "embedding_dim", lambda cfg: cfg.num_heads)
            optional.add(f"{attn}.relative_attention_bias")  # block 0 of a stack only
        mlp = f"{stack}.block.*.layer.{ff}.DenseReluDense"
        base.update({f"{mlp}.wi": "colwise", f"{mlp}.wi_0": "colwise", f"{mlp}.wi_1": "colwise",
                     f"{mlp}.wo": "rowwise"})
        expect[f"{mlp}.wo"] = ("Linear", None, None)
        optional.update((f"{mlp}.wi", f"{mlp}.wi_0", f"{mlp}.wi_1"))  # gated or not
    return Derivation(base=base, expect=expect, divisible=_t5_sizes, head={"lm_head": "output"},
                      optional=frozenset(optional),
                      needs={p: "decoder" for p in base if p.startswith("decoder.")})  # T5EncoderModel has none


def _bart() -> Derivation:
    base = {"shared": "embedding", "encoder.embed_tokens": "embedding", "decoder.embed_tokens": "embedding",
            # replicated, run on local tensors: the decoder's table takes its positions as a keyword argument
            "encoder.embed_positions": "local_params", "decoder.embed_positions": "local_params"}
    d_model = lambda cfg: cfg.d_model  # noqa: E731
    expect: dict[str, tuple[str | None, str | None, Width]] = {}
    for stack, attns in (("encoder", ("self_attn",)), ("decoder", ("self_attn", "encoder_attn"))):
        expect[f"{stack}.embed_tokens"] = ("Embedding", None, None)
        for a in attns:
            attn = f"{stack}.layers.*.{a}"
            for proj in ("q_proj", "k_proj", "v_proj"):
                base[f"{attn}.{proj}"] = "colwise"
                expect[f"{attn}.{proj}"] = ("Linear", "out_features", d_model)
            base[f"{attn}.out_proj"] = "rowwise"
            expect[f"{attn}.out_proj"] = ("Linear", "in_features", d_model)
            base[attn] = "divide_attrs:num_heads"
            expect[attn] = (None, "num_heads", None)
        base.update({f"{stack}.layers.*.fc1": "colwise", f"{stack}.layers.*.fc2": "rowwise"})
        expect.update({f"{stack}.layers.*.fc1": ("Linear", None, None),
                       f"{stack}.layers.*.fc2": ("Linear", None, None)})
    # BartForCausalLM holds the decoder alone (no shared table, no encoder)
    return Derivation(base=base, expect=expect, divisible=_bart_sizes, head={"lm_head": "output"},
                      optional=frozenset({"shared"}), needs={p: "encoder" for p in base if p.startswith("encoder.")})


def _vit() -> Derivation:
    def inner(cfg: object) -> int:
        return cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)

    attn = "layers.*.attention"
    base = {
        # its own cls_token, position_embeddings, mask_token: replicated, run on local tensors (the patch
        # convolution inside it is replicated as every module the plan leaves alone)
        "embeddings": "local_params",
        f"{attn}.q_proj": "colwise", f"{attn}.k_proj": "colwise", f"{attn}.v_proj": "colwise",
        f"{attn}.o_proj": "rowwise", attn: "divide_attrs:num_attention_heads",
        "layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise",
    }
    expect: dict[str, tuple[str | None, str | None, Width]] = {
        f"{attn}.{p}": ("Linear", "out_features", inner) for p in ("q_proj", "k_proj", "v_proj")}
    expect.update({f"{attn}.o_proj": ("Linear", "in_features", inner), attn: (None, "num_attention_heads", None),
                   "layers.*.mlp.fc1": ("Linear", None, None), "layers.*.mlp.fc2": ("Linear", None, None)})
    return Derivation(base=base, expect=expect, divisible=_vit_sizes)


DERIVED: dict[str, Derivation] = {
    "gpt2": Derivation(
        base={
            "wte": "embedding",
            "h.*.attn.c_attn": "packed_colwise:3",
            "h.*.attn": "divide_attrs:split_size",
            "h.*.attn.c_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
        },
        head={"lm_head": "output"},
        expect={
            "h.*.attn.c_attn": ("Conv1D", "nf", lambda cfg: 3 * cfg.hidden_size),  # q|k|v: three hidden-wide parts
            "h.*.attn.c_proj": ("Conv1D", "nf", _hidden),
            "h.*.mlp.c_fc": ("Conv1D", None, None),
            "h.*.mlp.c_proj": ("Conv1D", "nf", _hidden),
            "wte": ("Embedding", None, None),
            "lm_head": ("Linear", None, None),
        },
        divisible=_gpt2_sizes,
    ),
    "opt": Derivation(
        base={
            "decoder.embed_tokens": "embedding",
            # replicated, run on its local tensors: it takes its positions as a keyword argument, which the
            # DTensor ``replicate`` style would leave a plain tensor beside a DTensor table
            "decoder.embed_positions": "local_params",
            "decoder.layers.*.self_attn.q_proj": "colwise",
            "decoder.layers.*.self_attn.k_proj": "colwise",
            "decoder.layers.*.self_attn.v_proj": "colwise",
            "decoder.layers.*.self_attn.out_proj": "rowwise",
            "decoder.layers.*.self_attn": "divide_attrs:num_heads",
            "decoder.layers.*.fc1": "colwise",
            "decoder.layers.*.fc2": "rowwise",
        },
        head={"lm_head": "output"},
        expect={
            "decoder.layers.*.self_attn.q_proj": ("Linear", "out_features", _hidden),
            "decoder.layers.*.self_attn.k_proj": ("Linear", "out_features", _hidden),
            "decoder.layers.*.self_attn.v_proj": ("Linear", "out_features", _hidden),
            "decoder.layers.*.self_attn.out_proj": ("Linear", "in_features", _hidden),
            "decoder.layers.*.fc1": ("Linear", None, None),
            "decoder.layers.*.fc2": ("Linear", None, None),
            "decoder.embed_tokens": ("Embedding", None, None),
            "lm_head": ("Linear", None, None),
        },
        divisible=_opt_sizes,
    ),
    # the MLM decoder's bias is tied to the head's own ``bias`` parameter: split alike (a parameter entry)
    "bert": _bert_like({"cls.predictions.decoder": "output", "cls.predictions.bias": "colwise"}),
    "roberta": _bert_like({"lm_head.decoder": "output", "lm_head.bias": "colwise"}),
    "t5": _t5(),
    "bart": _bart(),
    "vit": _vit(),
    "falcon": Derivation(
        base={
            "word_embeddings": "embedding",
            "h.*.self_attention.query_key_value": "colwise",  # whole heads or groups: see the module's text
            "h.*.self_attention": "divide_attrs:num_heads,num_kv_heads",
            "h.*.self_attention.dense": "rowwise",
            "h.*.mlp.dense_h_to_4h": "colwise",
            "h.*.mlp.dense_4h_to_h": "rowwise",
        },
        head={"lm_head": "output"},
        expect={
            "h.*.self_attention.query_key_value": ("Linear", "out_features", _falcon_qkv_width),
            "h.*.self_attention": (None, "num_kv_heads", None),
            "h.*.self_attention.dense": ("Linear", "in_features", _hidden),
            "h.*.mlp.dense_h_to_4h": ("Linear", None, None),
            "h.*.mlp.dense_4h_to_h": ("Linear", None, None),
            "word_embeddings": ("Embedding", None, None),
            "lm_head": ("Linear", None, None),
        },
        divisible=_falcon_sizes,
        refuse=_falcon_refuse,
    ),
}

def _model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def _base_prefix(model: nn.Module) -> str:
    """``"bert."`` for a head class holding its base model under ``base_model_prefix``; "" for the base model
    itself or a class holding the base model's parts directly (T5ForConditionalGeneration)."""
    prefix = getattr(model, "base_model_prefix", "")
    sub = getattr(model, prefix, None) if prefix else None
    return f"{prefix}." if isinstance(sub, nn.Module) and sub is not model else ""


def _present(model: nn.Module, pattern: str) -> bool:
    """Whether ``pattern`` names a module of ``model`` or a parameter of one."""
    from lightning_par.parallel.tensor.tensor_parallel import match_modules

    if match_modules(model, pattern):
        return True
    owner, _, leaf = pattern.rpartition(".")
    return any(isinstance((model.get_submodule(o) if o else model)._parameters.get(leaf), nn.Parameter)
               for o in (match_modules(model, owner) if owner else [""]))


def derived_tp_plan(model: nn.Module) -> tuple[dict[str, str], dict[str, int]]:
    """The plan derived for ``model``'s family and the sizes tp must divide; ({}, {}) for a family with no
    derivation. ``ValueError`` (one line naming the family) when the family is refused or the built
    model breaks a fact the derivation relies on."""
    from lightning_par.parallel.tensor.tensor_parallel import match_modules

    mt = _model_type(model)
    who = f"{type(model).__name__} ({mt})"
    spec = DERIVED.get(mt)
    if spec is None:
        return {}, {}
    cfg = model.config
    why = spec.refuse(cfg) if spec.refuse is not None else None
    if why:
        raise ValueError(f"{who}: {why}")
    if getattr(cfg, "add_cross_attention", False) and not spec.cross_attention:
        raise ValueError(f"{who}: cross-attention layers are not in the derived tensor-parallel plan; build it with "
                         "add_cross_attention=false")
    prefix = _base_prefix(model)
    full = {p: prefix + p for p in spec.base} | {p: p for p in spec.head}
    plan: dict[str, str] = {}
    for pattern, style in [*spec.base.items(), *spec.head.items()]:
        if _present(model, full[pattern]):
            plan[full[pattern]] = style
        elif pattern in spec.base and pattern not in spec.optional and (
                pattern not in spec.needs or _present(model, prefix + spec.needs[pattern])):
            raise ValueError(f"{who}: the derived tensor-parallel plan expects {full[pattern]}, which this model lacks")
    for pattern, style in plan.items():  # the counts a forward sizes its views by, divided by tp
        if style.startswith("divide_attrs:"):
            for path in match_modules(model, pattern):
                missing = [a for a in style.partition(":")[2].split(",") if not hasattr(model.get_submodule(path), a)]
                if missing:
                    raise ValueError(f"{who}: {path} has no {missing[0]}, which the derived tensor-parallel plan "
                                     "divides by tp (its local heads)")
    for pattern, (cls, attr, width) in spec.expect.items():
        for path in match_modules(model, prefix + pattern if pattern in spec.base else pattern):
            module = model.get_submodule(path)
            if cls is not None and cls not in {c.__name__ for c in type(module).__mro__}:
                raise ValueError(f"{who}: {path} is a {type(module).__name__}, but the derived tensor-parallel plan "
                                 f"splits a {cls} there")
            if attr is None:
                continue
            if not hasattr(module, attr):
                raise ValueError(f"{who}: {path} has no {attr}, which the derived tensor-parallel plan relies on")
            split = any(isinstance(p, DTensor) for p in module.parameters())  # split already: widths now local
            if width is not None and not split and getattr(module, attr) != width(cfg):
                raise ValueError(f"{who}: {path}.{attr}={getattr(module, attr)}, not {width(cfg)} as the derived "
                                 "tensor-parallel plan assumes (whole heads per rank)")
    return plan, spec.divisible(cfg)
