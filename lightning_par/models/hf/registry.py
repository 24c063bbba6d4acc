"""transformers' own registry of causal language models, and a tiny config for any of them.

``causal_lm_types()`` lists every ``model_type`` that ``AutoModelForCausalLM`` knows (read from
transformers at run time, never a list written here); ``tiny_config(model_type)`` builds that
family's config with small sizes (two layers, hidden 64, four heads, 256 tokens), passing the sizes
to the config's own constructor so that what it derives from them (layer types, head dims, expert
counts) stays consistent. Used by the registry-walking tests and by anyone who wants a model of a
family without downloading one.
"""

from __future__ import annotations

from typing import Any

#: sizes handed to every config's constructor (a family ignores those it has no field for)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=256, max_position_embeddings=128, moe_intermediate_size=32,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
            shared_expert_intermediate_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False, use_cache=False,
            # rotary and multi-head latent attention sizes that fit a head of 16
            rotary_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=32)

#: sizes of the other token mixers and side tables (Mamba-2 and linear-attention heads, per-layer
#: embeddings, sparse-attention indexers), handed only to a family whose config has the field: their
#: defaults (128 Mamba heads of state 256 in chunks of 256, a 262,144-entry per-layer table) made a
#: "tiny" hybrid model train 30-60x slower than a tiny transformer
TINY_IF_PRESENT = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16, mamba_d_ssm=128,
                       mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, chunk_size=16,
                       linear_num_heads=4, linear_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16,
                       vocab_size_per_layer_input=256, hidden_size_per_layer_input=16, index_n_heads=4,
                       index_head_dim=16, ffn_dim=128, encoder_ffn_dim=128, decoder_ffn_dim=128)


def causal_lm_types() -> list[str]:
    """Every ``model_type`` in transformers' ``AutoModelForCausalLM`` mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def default_config(model_type: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type)


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The family's config at the ``TINY`` sizes (plus ``overrides``). A size the family's config derives
    rather than stores (Falcon's ``head_dim``, a read-only property) is left to it."""
    from transformers import AutoConfig, CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = default_config(model_type)
    sizes = {**TINY, **{k: v for k, v in TINY_IF_PRESENT.items() if getattr(default, k, None) not in (None, "auto")}}
    derived = {k for k in sizes if isinstance(getattr(cls, k, None), property) and getattr(cls, k).fset is None}
    return AutoConfig.for_model(model_type, **{**{k: v for k, v in sizes.items() if k not in derived}, **overrides})


def declared_tp_plan(model_type: str) -> dict[str, str]:
    """The base model's tensor-parallel plan the family's config declares ({} for none)."""
    return dict(getattr(default_config(model_type), "base_model_tp_plan", None) or {})
