"""The Hugging Face families whose own tensor-parallel plan, translated by ``hf/plan.py``, is proven
to train the same model as one device: measured, not assumed.

``tests/test_hf_tp_registry.py`` walks transformers' registry, splits every family that declares a
plan at tp=2 and compares 4 SGD steps (losses and every parameter) with the unsplit model; this set
is exactly the families that passed, and the test fails when the two disagree. A family outside it
is refused under tensor parallelism in one line: a plan that names only some of the modules a
family's forward needs split (a per-head norm applied after a transpose, a convolution in a Mamba
mixer) would otherwise train a different model without a word. Families that declare no plan but get
one derived (``hf/tp_derive.py``: GPT-2, OPT, BERT, RoBERTa, BART) are measured and gated the same way.
Measured with transformers 5.24.

Families outside that walk -- not causal LMs (T5, ViT; BART's seq2seq model, whose causal-LM head the
walk measures) or built there in a layout tp cannot split (Falcon's default ``multi_query``: one
key/value head) -- are measured by ``tests/test_encoder_tp.py``
instead (``VERIFIED_TP_OTHER_FAMILIES``): the derived plan trains 8 steps under ``lp_tensor_parallel``
(and T5 under ``lp_fsdp_tp``) with losses within rtol 1e-5 of ``lp_single``, and every parameter of
each head class the derivation covers within 2e-5 of the unsplit model after 4 steps.
"""

from __future__ import annotations

#: the transformers release the set was measured with (a newer one may add or change families)
MEASURED_WITH = "5.24."

VERIFIED_TP_FAMILIES = frozenset({
    "afmoe", "arcee", "aria_text", "bart", "beam", "bert", "codegen", "cohere", "cohere2", "cohere2_moe", "cwm",
    "deepseek_v2", "deepseek_v4", "diffllama", "dory", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "flex_olmo", "flint",
    "gemma", "gemma2", "gemma3_text", "glm", "glm4", "glm4_moe", "gpt2", "gpt_neox", "gptj", "granite",
    "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "helium", "hrm_text", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "hy_v3", "hy_v4", "hyperclovax", "internlm3", "iquestcoder", "jais2", "kolibri1", "laguna", "lfm2",
    "llama", "llama4_text", "mellum", "mimo_v2_flash", "minicpm3", "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral",
    "ministral3", "mistral", "mixtral", "nanochat", "nemotron", "olmo", "olmo2", "olmo3", "olmoe", "opt", "phi", "phi3", "qwen2",
    "qwen2_moe", "qwen3", "qwen3_moe", "roberta", "sarvam_mla", "seed_oss", "smollm3", "solar_open", "starcoder2",
    "vaultgemma"
})

#: derived plans measured by ``tests/test_encoder_tp.py`` rather than the registry walk (see above)
VERIFIED_TP_OTHER_FAMILIES = frozenset({"bart", "falcon", "t5", "vit"})


def tp_unverified_reason(model: object) -> str:
    """One line when ``model``'s family is not among the verified ones, else ''."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in VERIFIED_TP_FAMILIES or model_type in VERIFIED_TP_OTHER_FAMILIES:
        return ""
    return (f"{type(model).__name__} ({model_type}): its tensor-parallel plan is not verified to train the same "
            "model as one device (tests/test_hf_tp_registry.py, tests/test_encoder_tp.py); use a data-parallel or "
            "sharded strategy (ddp, zero3, fsdp), or declare your own parallel_plan().tp_plan")
