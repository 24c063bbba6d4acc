"""The Hugging Face families whose own tensor-parallel plan, translated by ``hf_plan.py``, is proven
to train the same model as one device: measured, not assumed.

``tests/test_hf_tp_registry.py`` walks transformers' registry, splits every family that declares a
plan at tp=2 and compares 4 SGD steps (losses and every parameter) with the unsplit model; this set
is exactly the families that passed, and the test fails when the two disagree. A family outside it
is refused under tensor parallelism in one line: a plan that names only some of the modules a
family's forward needs split (a per-head norm applied after a transpose, a convolution in a Mamba
mixer) would otherwise train a different model without a word. Measured with transformers 5.24.
"""

from __future__ import annotations

#: the transformers release the set was measured with (a newer one may add or change families)
MEASURED_WITH = "5.24."

VERIFIED_TP_FAMILIES = frozenset({
    "arcee", "codegen", "cohere", "cohere2", "cwm", "diffllama", "dory", "ernie4_5", "exaone", "exaone4", "gemma",
    "gemma2", "gemma3_text", "glm", "glm4", "gpt_neox", "gptj", "granite", "helium", "hrm_text", "hunyuan_v1_dense",
    "hyperclovax", "internlm3", "iquestcoder", "jais2", "lfm2", "llama", "ministral", "ministral3", "mistral",
    "nanochat", "nemotron", "olmo2", "phi", "phi3", "qwen2", "qwen3", "smollm3", "starcoder2", "vaultgemma",
})


def tp_unverified_reason(model: object) -> str:
    """One line when ``model``'s family is not among the verified ones, else ''."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in VERIFIED_TP_FAMILIES:
        return ""
    return (f"{type(model).__name__} ({model_type}): its tensor-parallel plan is not verified to train the same "
            "model as one device (tests/test_hf_tp_registry.py); use a data-parallel or sharded strategy "
            "(ddp, zero3, fsdp), or declare your own parallel_plan().tp_plan")
