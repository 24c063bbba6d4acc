"""Tensor-parallel plans for Hugging Face families that declare none but whose layout is standard.

transformers declares no ``base_model_tp_plan`` for GPT-2 or OPT, yet both are Megatron-LM's layout:
attention projections split by heads then a row-split output projection, a two-linear MLP, and a
vocabulary-split embedding tied to the LM head. A derivation here writes that plan in our style names
(``tp_styles.STYLES``) for one family and checks, on the built model, the facts the plan relies
on (each split module's class and its fused width); a model that breaks one is refused in one line.
A derived plan then meets the same gate as a declared one: the family must be in
``hf_tp_verified.VERIFIED_TP_FAMILIES``, which ``tests/test_hf_tp_registry.py`` measures (parity at
tp=2 with the unsplit model). Nothing here imports transformers.

- GPT-2: ``Conv1D`` stores its weight ``(in, out)``; ``c_attn`` is ``q|k|v`` packed along the output
  features, so it is ``packed_colwise:3`` (each rank its heads of each of q, k, v), and the attention
  splits the fused output by ``split_size`` (the hidden size), which becomes hidden / tp
  (``divide_attrs``); ``c_proj`` rowwise; ``mlp.c_fc`` colwise, ``mlp.c_proj`` rowwise; ``wte`` split
  by vocabulary rows and the tied ``lm_head`` alike, so the tie holds (``tensor_parallel._retie_split``).
- OPT: q/k/v colwise, ``out_proj`` rowwise, ``fc1`` colwise, ``fc2`` rowwise; its attention views
  ``(B, T, num_heads, head_dim)``, so ``num_heads`` becomes heads / tp; embedding and tied head as GPT-2.
- Falcon: refused. Its fused ``query_key_value`` packs q|k|v per key/value group, in a layout that
  changes with ``new_decoder_architecture``, ``multi_query`` and ``num_kv_heads`` (a kv group's queries
  then its k and v; or all queries then one shared k, v); splitting it right needs a per-layout
  permutation that is not written, and a wrong one would train a different model silently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Derivation:
    plan: dict[str, str]  #: pattern -> our style name
    #: pattern -> (class name, attribute, multiple of the hidden size) the plan relies on; None: any
    expect: dict[str, tuple[str, str | None, int]]
    divisible: Callable[[object], dict[str, int]]  #: sizes tp must divide, from the config


def _gpt2_sizes(cfg: object) -> dict[str, int]:
    hidden = cfg.n_embd
    return {"attention heads": cfg.n_head, "MLP size": cfg.n_inner or 4 * hidden, "vocab_size": cfg.vocab_size}


def _opt_sizes(cfg: object) -> dict[str, int]:
    return {"attention heads": cfg.num_attention_heads, "MLP size": cfg.ffn_dim, "vocab_size": cfg.vocab_size}


DERIVED: dict[str, Derivation] = {
    "gpt2": Derivation(
        plan={
            "transformer.wte": "embedding",
            "transformer.h.*.attn.c_attn": "packed_colwise:3",
            "transformer.h.*.attn": "divide_attrs:split_size",
            "transformer.h.*.attn.c_proj": "rowwise",
            "transformer.h.*.mlp.c_fc": "colwise",
            "transformer.h.*.mlp.c_proj": "rowwise",
            "lm_head": "output",
        },
        expect={
            "transformer.h.*.attn.c_attn": ("Conv1D", "nf", 3),  # q|k|v: three hidden-wide parts
            "transformer.h.*.attn.c_proj": ("Conv1D", "nf", 1),
            "transformer.h.*.mlp.c_fc": ("Conv1D", None, 0),
            "transformer.h.*.mlp.c_proj": ("Conv1D", "nf", 1),
            "transformer.wte": ("Embedding", None, 0),
            "lm_head": ("Linear", None, 0),
        },
        divisible=_gpt2_sizes,
    ),
    "opt": Derivation(
        plan={
            "model.decoder.embed_tokens": "embedding",
            # replicated, run on its local tensors: it takes its positions as a keyword argument, which the
            # DTensor ``replicate`` style would leave a plain tensor beside a DTensor table
            "model.decoder.embed_positions": "local_params",
            "model.decoder.layers.*.self_attn.q_proj": "colwise",
            "model.decoder.layers.*.self_attn.k_proj": "colwise",
            "model.decoder.layers.*.self_attn.v_proj": "colwise",
            "model.decoder.layers.*.self_attn.out_proj": "rowwise",
            "model.decoder.layers.*.self_attn": "divide_attrs:num_heads",
            "model.decoder.layers.*.fc1": "colwise",
            "model.decoder.layers.*.fc2": "rowwise",
            "lm_head": "output",
        },
        expect={
            "model.decoder.layers.*.self_attn.q_proj": ("Linear", "out_features", 1),
            "model.decoder.layers.*.self_attn.k_proj": ("Linear", "out_features", 1),
            "model.decoder.layers.*.self_attn.v_proj": ("Linear", "out_features", 1),
            "model.decoder.layers.*.self_attn.out_proj": ("Linear", "in_features", 1),
            "model.decoder.layers.*.fc1": ("Linear", None, 0),
            "model.decoder.layers.*.fc2": ("Linear", None, 0),
            "model.decoder.embed_tokens": ("Embedding", None, 0),
            "lm_head": ("Linear", None, 0),
        },
        divisible=_opt_sizes,
    ),
}

#: families whose layout we looked at and do not derive: one line each, said when tp is asked for
NOT_DERIVED = {
    "falcon": "Falcon's fused query_key_value packs q|k|v per key/value group in a layout that depends on "
              "new_decoder_architecture, multi_query and num_kv_heads; no tensor-parallel plan is derived for it",
}


def _model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def derived_tp_plan(model: nn.Module) -> tuple[dict[str, str], dict[str, int]]:
    """The plan derived for ``model``'s family and the sizes tp must divide; ({}, {}) for a family with no
    derivation. ``ValueError`` (one line naming the family) when the family is refused or the built
    model breaks a fact the derivation relies on."""
    from lightning_par.parallel.tensor_parallel import match_modules

    mt = _model_type(model)
    if mt in NOT_DERIVED:
        raise ValueError(f"{type(model).__name__} ({mt}): {NOT_DERIVED[mt]}")
    spec = DERIVED.get(mt)
    if spec is None:
        return {}, {}
    cfg = model.config
    hidden = getattr(cfg, "hidden_size", None)
    if getattr(cfg, "add_cross_attention", False):
        raise ValueError(f"{type(model).__name__} ({mt}): cross-attention layers are not in the derived "
                         "tensor-parallel plan; build it with add_cross_attention=false")
    for pattern, (cls, attr, mult) in spec.expect.items():
        paths = match_modules(model, pattern)
        if not paths:
            raise ValueError(f"{type(model).__name__} ({mt}): the derived tensor-parallel plan expects {pattern}, "
                             "which this model lacks")
        for path in paths:
            module = model.get_submodule(path)
            if type(module).__name__ != cls:
                raise ValueError(f"{type(model).__name__} ({mt}): {path} is a {type(module).__name__}, but the derived "
                                 f"tensor-parallel plan splits a {cls} there")
            split = any(isinstance(p, DTensor) for p in module.parameters(recurse=False))  # widths now local
            if attr is not None and not split and getattr(module, attr, None) != mult * hidden:
                raise ValueError(f"{type(model).__name__} ({mt}): {path}.{attr}={getattr(module, attr, None)}, not "
                                 f"{mult} x hidden ({mult * hidden}) as the derived tensor-parallel plan assumes")
    return dict(spec.plan), spec.divisible(cfg)
