"""Ties under pipelines, checked before launch: the refusals and their advice. (The families the
rest of the suite does not use -- BERT, OPT, tied Llama, T5, a ViT, Mixtral, Qwen2-MoE and more -- run
under every strategy in ``test_family_matrix.py``.)"""

from __future__ import annotations

import pytest


def test_pipeline_tie_refusals_give_advice_that_can_be_followed() -> None:
    """A pipeline keeps a tie whose uses all lie inside pipeline layers (a copy per stage, kept equal:
    ``pipeline/stage_ties.py``), so tied Llama passes with its own plan. A use outside every layer is refused,
    with advice that works: Llama's head tie goes with tie_word_embeddings=false (and the untied
    model passes); T5's shared table stays tied whatever the flag, so T5 is not told to set it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, T5Config, T5ForConditionalGeneration

    from lightning_par.parallel.hf.plan import check_tied

    def llama(tie: bool):
        cfg = AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, vocab_size=128, tie_word_embeddings=tie)
        return AutoModelForCausalLM.from_config(cfg)

    with torch.device("meta"):
        t5 = T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8,
                                                 vocab_size=128, tie_word_embeddings=False))
        tied, untied = llama(True), llama(False)
    check_tied(tied, pp=2)  # its own plan: embedding and head are pipeline layers
    with pytest.raises(ValueError, match=r"no option of the model unties them.*use pp=1") as e:
        check_tied(t5, pp=2, layers=("encoder", "decoder", "lm_head"))  # 'shared' in no layer
    assert "tie_word_embeddings=false" not in str(e.value) and "\n" not in str(e.value)
    no_head = ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm")
    with pytest.raises(ValueError, match="build the model with tie_word_embeddings=false"):
        check_tied(tied, pp=2, layers=no_head)
    check_tied(untied, pp=2, layers=no_head)  # the advice, followed
    check_tied(tied, tp=2)  # tensor parallelism keeps the tie
