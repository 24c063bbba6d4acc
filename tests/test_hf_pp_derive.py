"""A pipeline plan derived for a Hugging Face decoder that declares none (``parallel/hf/pp_derive.py``):
the layers in call order, and where a stage may start. A cut where the forward does not pass the
previous layer's output on (GPT-2 between ``wte`` and ``wpe``: ``wpe`` is called with the position
ids) would train a wrong model without any error, so it is refused in one line wherever a cut is
made: explicit split points, balanced cuts, the strategy's check before launch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_par.models.hf.causal_lm import HFCausalLM
from lightning_par.parallel.hf.stages import check_hf_pipeline
from lightning_par.parallel.hf.plan import hf_parallel_plan
from lightning_par.parallel.pipeline.schedule import balance_layers, build_stage_modules
from lightning_par.parallel.pipeline.stages import check_stage_starts, measure_layer_times, resolve_split_points
from lightning_par.strategies.pipeline import PipelineStrategy
from lightning_par.parallel.hf.stages import hf_stage_runner

GPT2_LAYERS = ("transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.ln_f",
               "lm_head")


def gpt2(**kw):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, **kw)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval()


def test_gpt2_plan_is_derived_from_its_forward():
    plan = hf_parallel_plan(gpt2())
    assert plan.layers == GPT2_LAYERS and plan.pp_refusal == ""
    assert plan.stage_starts == (0, 2, 3, 4, 5)  # never at wpe
    assert plan.prefixed("net").stage_starts == plan.stage_starts


def test_opt_plan_never_starts_at_its_position_embedding():
    from transformers import OPTConfig, OPTForCausalLM

    with torch.device("meta"):
        model = OPTForCausalLM(OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                                         word_embed_proj_dim=16, vocab_size=96, max_position_embeddings=32))
    plan = hf_parallel_plan(model)
    assert plan.layers == ("model.decoder.embed_tokens", "model.decoder.embed_positions", "model.decoder.project_in",
                           "model.decoder.layers.0", "model.decoder.layers.1", "model.decoder.final_layer_norm",
                           "model.decoder.project_out", "lm_head")
    # embed_positions takes the mask; project_in the token embeddings before the positions are added
    assert plan.stage_starts == (0, 3, 4, 5, 6, 7)


def test_a_cut_where_the_forward_passes_no_hidden_states_is_refused_in_one_line():
    plan = hf_parallel_plan(gpt2())
    layers, starts = plan.layers, plan.stage_starts
    for point in ("transformer.wpe", 1):
        with pytest.raises(ValueError, match="cannot start at 'transformer.wpe'") as e:
            resolve_split_points(layers, [point], 2, starts)
        assert "\n" not in str(e.value)
    assert resolve_split_points(layers, ["transformer.h.1"], 2, starts) == [0, 3, 6]
    with pytest.raises(ValueError, match="cannot start at"):
        check_stage_starts(layers, [0, 1, 6], starts)
    # balanced cuts keep to the starts: wte + wpe are one unit, whatever their costs
    assert balance_layers([1, 100, 1, 1, 1, 1], 2, starts) == [0, 2, 6]
    assert balance_layers([100, 1, 1, 1, 1, 1], 3, starts) == [0, 2, 5, 6]
    with pytest.raises(ValueError, match="may start at only 5"):
        balance_layers([1] * 6, 6, starts)


def test_the_pipeline_strategy_refuses_a_split_point_at_a_disallowed_start():
    model = HFCausalLM(arch="gpt2", hidden=32, layers=2, heads=4, vocab=256, max_positions=32, seq_len=16)
    PipelineStrategy(split_points=["transformer.h.1"]).validate_setup(2, model)
    with pytest.raises(ValueError, match="cannot start at 'net.transformer.wpe'") as e:
        PipelineStrategy(split_points=["transformer.wpe"]).validate_setup(2, model)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="cannot cut 6 layers, of which a stage may start at only 5, into 6") as e:
        PipelineStrategy().validate_setup(6, model)  # 6 layers, but wte and wpe are one place to start
    assert "\n" not in str(e.value)


def test_the_disallowed_cut_is_not_the_model():
    """What the refusal prevents: cut before wpe, the second stage receives the position ids as its
    activation (here it then fails on shapes; at other sizes it could compute a different model)."""
    model = gpt2()
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids, use_cache=False).logits
    for bounds, equal in (([0, 2, 6], True), ([0, 1, 6], False)):
        x = ids
        try:
            for stage in build_stage_modules(model, layers=GPT2_LAYERS, boundaries=bounds, stage_indices=range(2), stage_runner=hf_stage_runner):
                x = stage(x)
        except RuntimeError:
            x = None
        assert (x is not None and x.shape == want.shape and torch.allclose(x, want, rtol=1e-5, atol=1e-5)) is equal


def test_the_derived_plan_cuts_gpt2_exactly_with_its_tie():
    model = gpt2()
    plan = hf_parallel_plan(model)
    check_hf_pipeline(model, plan.layers, starts=plan.stage_starts)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids, use_cache=False).logits
    F.cross_entropy(want.flatten(0, 1), ids.flatten()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for bounds in ([0, 2, 6], [0, 3, 6], [0, 4, 6], [0, 5, 6], [0, 2, 3, 4, 5, 6]):
        model.zero_grad(set_to_none=True)
        x = ids
        for stage in build_stage_modules(model, layers=plan.layers, boundaries=bounds,
                                         stage_indices=range(len(bounds) - 1), stage_runner=hf_stage_runner):
            x = stage(x)
        F.cross_entropy(x.flatten(0, 1), ids.flatten()).backward()
        torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6, msg=f"{n} at {bounds}")


def test_a_plan_leaving_a_parameter_outside_every_layer_is_refused_in_one_line():
    model = gpt2()
    layers = tuple(x for x in GPT2_LAYERS if x != "transformer.ln_f")
    with pytest.raises(ValueError, match="'transformer.ln_f.weight' lies in no layer") as e:
        check_hf_pipeline(model, layers)
    assert "\n" not in str(e.value)


def test_an_encoder_gets_a_derived_plan_and_an_encoder_decoder_one_line_why():
    from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

    with torch.device("meta"):
        bert = BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, vocab_size=96))
        t5 = T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=96))
    plan = hf_parallel_plan(bert)  # embeddings, each encoder layer, the MLM head (tests/test_encoder_pp.py trains it)
    assert plan.layers[0] == "bert.embeddings" and plan.layers[-1] == "cls" and len(plan.layers) == 4, plan.layers
    refusal = hf_parallel_plan(t5).pp_refusal
    assert hf_parallel_plan(t5).layers == () and "encoder-decoder" in refusal and "\n" not in refusal


def test_time_balance_measures_from_one_allowed_start_to_the_next():
    model = gpt2()
    plan = hf_parallel_plan(model)
    costs = measure_layer_times(model, plan.layers, torch.zeros(2, 8, dtype=torch.long), repeats=1,
                                starts=plan.stage_starts, stage_runner=hf_stage_runner)
    assert len(costs) == 6 and costs[1] == 0.0 and all(c > 0 for i, c in enumerate(costs) if i != 1)
    assert all(p.grad is None for p in model.parameters())
    assert balance_layers(costs, 2, plan.stage_starts)[1] != 1
