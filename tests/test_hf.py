"""Hugging Face causal LMs built from a config: the plan read off the model, initialisation, tied
embeddings, pipeline stages, checkpointing; then end-to-end loss parity under every strategy."""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
from torch import nn

from lightning_par.models.build import instantiate_model
from lightning_par.models.hf.causal_lm import HFCausalLM, LogitsOnly
from lightning_par.parallel.hf.plan import (
    HF_STYLES,
    check_tied,
    declared_ties,
    hf_blocks,
    hf_enable_checkpointing,
    hf_init_all,
    hf_init_fn,
    hf_parallel_plan,
    hf_tp_plan,
    retie,
    tied_parameters,
    verify_ties,
)
from lightning_par.parallel.pipeline.schedule import build_stage_modules
from lightning_par.parallel.hf.stages import hf_stage_runner
from tests import launch
from tests.helpers import assert_losses_match
from tests.sweeps import together

ROPE_ARCHS = ("llama", "qwen2", "mistral")


def tiny(arch: str, **kw) -> HFCausalLM:
    sizes = dict(hidden=64, layers=3, heads=4, max_positions=64)
    if arch != "gpt2":
        sizes.update(kv_heads=2, intermediate=128)
    sizes.update(kw)
    return HFCausalLM(arch=arch, **sizes)


def built(arch: str, **kw) -> HFCausalLM:
    m = tiny(arch, **kw)
    m.configure_model()
    return m


# ---------------------------------------------------------------------------------------------
# The plan


@pytest.mark.parametrize("arch", ROPE_ARCHS)
def test_plan_of_rope_models_comes_from_the_model(arch):
    m = built(arch)
    plan = m.parallel_plan()
    hf = m.net
    n = hf.config.num_hidden_layers
    assert plan.blocks == tuple(f"net.model.layers.{i}" for i in range(n))
    assert plan.layers == ("net.model.embed_tokens", *plan.blocks, "net.model.norm", "net.lm_head")
    # every entry of the model's own TP plan, translated; nothing invented
    want = {f"net.{k}": HF_STYLES[v] for k, v in hf._tp_plan.items()}
    assert plan.tp_plan == want
    assert plan.tp_plan["net.lm_head"] == "output" and plan.tp_plan["net.model.embed_tokens"] == "embedding"
    assert plan.tp_plan["net.model.layers.*.self_attn.o_proj"] == "rowwise"
    assert plan.tp_divisible == {"attention heads": 4, "key/value heads": 2, "MLP size": 128, "vocab_size": 256}
    for path in plan.layers + plan.blocks:
        m.get_submodule(path)
    # the plan is the same before the model is built (validation runs before configure_model)
    assert tiny(arch).parallel_plan() == plan


def test_plan_of_gpt2():
    m = built("gpt2", tie_word_embeddings=True)
    plan = m.parallel_plan()
    assert plan.blocks == ("net.transformer.h.0", "net.transformer.h.1", "net.transformer.h.2")
    # GPT-2 declares no pipeline plan: this one is derived from its forward (hf/pp_derive.py)
    assert plan.layers == ("net.transformer.wte", "net.transformer.wpe", *plan.blocks, "net.transformer.ln_f",
                           "net.lm_head")
    assert plan.stage_starts == (0, 2, 3, 4, 5, 6)  # never at wpe: it is called with the position ids
    # nor a tensor-parallel one: it is derived (hf/tp_derive.py), q|k|v packed in the fused c_attn
    assert plan.tp_plan["net.transformer.h.*.attn.c_attn"] == "packed_colwise:3" and not plan.tp_refusal
    assert tied_parameters(m) == [("net.transformer.wte.weight", "net.lm_head.weight")]
    assert declared_ties(m) == [("net.transformer.wte.weight", "net.lm_head.weight")]


def test_plan_of_non_hf_module_is_none():
    assert hf_parallel_plan(nn.Linear(2, 2)) is None


def test_untranslatable_tp_style_drops_the_whole_tp_plan():
    m = built("llama")
    m.net._tp_plan = {**m.net._tp_plan, "model.layers.*.mlp.gate_proj": "colwise_from_the_future"}
    with pytest.raises(ValueError, match="colwise_from_the_future"):
        hf_tp_plan(m.net)
    plan = hf_parallel_plan(m.net)
    assert plan.tp_plan == {} and plan.tp_divisible == {} and plan.blocks  # other techniques still work


# ---------------------------------------------------------------------------------------------
# Initialisation


def _stats(model: nn.Module) -> dict[str, tuple[float, float]]:
    return {n: (t.float().mean().item(), t.float().std().item()) for n, t in model.state_dict().items()}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_init_fn_reproduces_from_config(arch):
    m = tiny(arch, hidden=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    ref = m.build_hf("cpu")
    meta = m.build_hf("meta")
    meta.to_empty(device="cpu")  # garbage values, ties broken, inv_freq garbage
    assert not verify_ties_ok(meta)
    retie(meta, declared_ties(meta))
    torch.manual_seed(1)
    hf_init_all(meta)
    assert tied_parameters(meta) == tied_parameters(ref) != []
    ref_stats, got = _stats(ref), _stats(meta)
    assert ref_stats.keys() == got.keys()
    for name, (mean, std) in ref_stats.items():
        g_mean, g_std = got[name]
        assert abs(g_mean - mean) < 3e-3, (name, g_mean, mean)
        assert math.isclose(g_std, std, rel_tol=0.05, abs_tol=1e-6), (name, g_std, std)
    for name, buf in ref.named_buffers():  # rotary inv_freq: recomputed exactly
        torch.testing.assert_close(meta.get_buffer(name), buf, rtol=0, atol=0)


def verify_ties_ok(model: nn.Module) -> bool:
    try:
        verify_ties(model)
        return True
    except ValueError:
        return False


def test_init_is_order_independent_for_gpt2_scaled_projections():
    """GPT-2's attention/MLP rule rescales its child c_proj: a top-down visit must give the same law."""
    m = tiny("gpt2", hidden=128, layers=8)
    meta = m.build_hf("meta")
    init = hf_init_fn(meta)
    block = copy.deepcopy(meta.get_submodule(hf_blocks(meta)[0])).to_empty(device="cpu")
    torch.manual_seed(0)
    for sub in block.modules():  # parents before children: the opposite of Hugging Face's order
        init(sub)
    want = 0.02 / math.sqrt(2 * 8)
    assert math.isclose(block.attn.c_proj.weight.std().item(), want, rel_tol=0.05)
    assert math.isclose(block.mlp.c_proj.weight.std().item(), want, rel_tol=0.05)
    assert math.isclose(block.attn.c_attn.weight.std().item(), 0.02, rel_tol=0.05)
    assert torch.equal(block.ln_1.weight, torch.ones(128))
    with pytest.raises(ValueError, match="not a submodule"):
        init(nn.Linear(2, 2))


def test_init_touches_only_what_the_module_owns():
    m = tiny("gpt2")
    meta = m.build_hf("meta")
    init = hf_init_fn(meta)
    attn = copy.deepcopy(meta.transformer.h[0].attn).to_empty(device="cpu")
    with torch.no_grad():
        for p in attn.parameters():
            p.fill_(7.0)
    init(attn)  # GPT2Attention owns no tensors itself: its c_proj rule must not fire from here
    assert all(bool((p == 7.0).all()) for p in attn.parameters())


def test_model_init_weights_contract():
    m = tiny("llama")
    m.configure_model()
    layer = copy.deepcopy(m.net.model.layers[0])
    with torch.no_grad():
        for p in layer.parameters():
            p.zero_()
    for sub in layer.modules():
        m.init_weights(sub)
    assert math.isclose(layer.self_attn.q_proj.weight.std().item(), 0.02, rel_tol=0.1)
    assert torch.equal(layer.input_layernorm.weight, torch.ones(64))


# ---------------------------------------------------------------------------------------------
# Forward, loss, tied gradients


@pytest.mark.parametrize("arch", ["gpt2", *ROPE_ARCHS])
def test_forward_and_loss(arch):
    m = built(arch)
    x = torch.randint(0, 256, (2, 16))
    logits = m(x)
    assert logits.shape == (2, 16, 256)
    loss = m.loss_fn(logits, x)
    assert abs(loss.item() - math.log(256)) < 0.5  # near-uniform at init
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())


def test_tied_gradient_reaches_both_uses():
    m = built("gpt2", tie_word_embeddings=True)
    untied = copy.deepcopy(m)
    untied.net.lm_head.weight = nn.Parameter(untied.net.transformer.wte.weight.detach().clone())
    assert tied_parameters(untied) == []
    x = torch.randint(0, 256, (2, 16))
    m.loss_fn(m(x), x).backward()
    untied.loss_fn(untied(x), x).backward()
    both = untied.net.transformer.wte.weight.grad + untied.net.lm_head.weight.grad
    torch.testing.assert_close(m.net.transformer.wte.weight.grad, both)
    assert untied.net.lm_head.weight.grad.abs().sum() > 0 and untied.net.transformer.wte.weight.grad.abs().sum() > 0


def test_check_tied_refuses_layouts_that_untie():
    gpt2 = tiny("gpt2", tie_word_embeddings=True)
    gpt2.check_tied(tp=1, pp=1)
    gpt2.check_tied(tp=2)  # tensor parallelism keeps ties (tensor_parallel._retie_split)
    gpt2.check_tied(pp=2)  # the derived pipeline plan holds wte and lm_head: pipeline_ties keeps the copies equal
    tiny("llama").check_tied(tp=2, pp=2)  # untied: anything goes
    tied_llama = built("llama", tie_word_embeddings=True)
    check_tied(tied_llama, pp=2)
    # a layout whose layers leave a use outside every stage: one line, advice that can be followed
    with pytest.raises(ValueError, match="outside every pipeline layer.*tie_word_embeddings=false"):
        check_tied(tied_llama, pp=2, layers=("net.model.embed_tokens", "net.model.layers.0"))


def test_verify_ties_detects_a_silent_untie():
    m = built("llama", tie_word_embeddings=True)
    verify_ties(m)
    m.net.lm_head.weight = nn.Parameter(m.net.lm_head.weight.detach().clone())
    with pytest.raises(ValueError, match="separate parameter"):
        verify_ties(m)


# ---------------------------------------------------------------------------------------------
# Pipeline stages and checkpointing


@pytest.mark.parametrize("arch", ROPE_ARCHS)
def test_pipeline_stages_compute_the_whole_model(arch):
    m = built(arch, layers=4)
    x = torch.randint(0, 256, (2, 32))
    whole = m(x)
    plan = m.parallel_plan()
    stages = build_stage_modules(m, layers=plan.layers, boundaries=[0, 2, 4, len(plan.layers)],
                                 stage_indices=[0, 1, 2], stage_runner=hf_stage_runner)
    h = x
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, whole, rtol=0, atol=0)
    names = [n for s in stages for n in s.state_dict()]
    assert sorted(names) == sorted(m.state_dict())  # the same keys as the unsplit model


def test_hf_checkpointing_same_gradients():
    m = built("llama")
    x = torch.randint(0, 256, (2, 16))
    m.loss_fn(m(x), x).backward()
    ref = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    assert hf_enable_checkpointing(m) is True
    assert all(layer.gradient_checkpointing for layer in m.net.model.layers)
    m.train()
    m.loss_fn(m(x), x).backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-6, atol=1e-7)
    assert hf_enable_checkpointing(nn.Linear(2, 2)) is False


def test_flops_copy_runs_on_meta():
    m = tiny("llama")
    net = m.build_net("meta")
    assert isinstance(net, LogitsOnly)
    out = net(m.example_input(2, "meta"))
    assert out.shape == (2, 64, 256) and out.is_meta


# ---------------------------------------------------------------------------------------------
# Configuration errors


def test_bad_sizes_are_one_line_errors():
    with pytest.raises(ValueError, match="vocab=100 is below 256"):
        HFCausalLM(arch="llama", vocab=100)
    with pytest.raises(ValueError, match="unknown arch 'bert'"):
        HFCausalLM(arch="bert")
    with pytest.raises(ValueError, match="not divisible by heads"):
        HFCausalLM(arch="llama", hidden=30, heads=4)
    with pytest.raises(ValueError, match="seq_len=200 exceeds"):
        HFCausalLM(arch="llama", max_positions=128, seq_len=200)


def test_missing_transformers_says_how_to_install():
    code = ("import sys\n"
            "from lightning_par.models.hf.causal_lm import HFCausalLM\n"
            "sys.modules['transformers'] = None  # as if not installed\n"
            "try:\n    HFCausalLM()\nexcept ImportError as e:\n    print(e)\n")
    out = launch.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "HFCausalLM needs transformers: pip install 'lightning_par[hf]'", out.stderr


def test_realistic_preset_size():
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_par.conf", version_base="1.3"):
        cfg = compose("config", overrides=["model=hf_llama_1b"])
    m = instantiate_model(cfg.model)
    n = sum(p.numel() for p in m.build_hf("meta").parameters())
    assert 1.2e9 < n < 1.3e9, n  # Llama-3.2-1B: 1.24B with tied embeddings


# ---------------------------------------------------------------------------------------------
# End to end: loss parity with the single-device run (subprocesses through run.py)

# The runs are Hydra multiruns shared through tests/sweeps.py (one parent process per sweep, not one per
# cell): 12 steps of the quick experiment (seq 64, global batch 8) on a tiny Llama and a tiny GPT-2.
DATA = "data.max_bytes=400000"
MODELS = "model=hf_llama_tiny,hf_gpt2_tiny"
PARITY = {  # strategy -> devices
    "ddp": 2, "zero1": 2, "zero2": 2, "zero3": 2, "zero3_offload": 2, "fsdp": 2, "hsdp": 4,
    "tensor_parallel": 2, "pipeline": 2, "fsdp_tp": 4, "3d": 4,  # 3d: pp=2 x tp=2 (dp=1)
}


def _by_model_and_strategy(summaries: list[dict]) -> dict[tuple[str, str], dict]:
    return {(s["model"], s["strategy"]): s for s in summaries}


PARITY_TWO = (MODELS, f"strategy=single,{','.join(s for s, d in PARITY.items() if d == 2)}", "trainer.devices=2", DATA)
PARITY_FOUR = (MODELS, f"strategy={','.join(s for s, d in PARITY.items() if d == 4)}", "trainer.devices=4", DATA)


def summary_of(model: str, strategy: str) -> dict:
    """The run of ``model`` under ``strategy`` (``single``: the reference) from the shared sweeps."""
    from tests.sweeps import sweep

    if strategy == "single" or PARITY[strategy] == 2:
        runs = sweep(*PARITY_TWO, timeout=1400)
    else:
        runs = sweep(*PARITY_FOUR, timeout=1400)
    return _by_model_and_strategy(runs)[(model, strategy)]


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("strategy", list(PARITY))
def test_llama_parity(strategy):
    ref = summary_of("hf_llama_tiny", "single")
    got = summary_of("hf_llama_tiny", strategy)
    assert got["world_size"] == PARITY[strategy] and ref["world_size"] == 1
    assert_losses_match(got, ref)


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("strategy", list(PARITY))
def test_gpt2_tied_parity(strategy):  # pipeline, tensor_parallel, fsdp_tp, 3d: derived plans
    ref = summary_of("hf_gpt2_tiny", "single")
    got = summary_of("hf_gpt2_tiny", strategy)
    assert got["world_size"] == PARITY[strategy]
    # unsharded strategies hold each parameter once: an untied lm_head would add a vocab x hidden matrix
    for summary in (ref, got) if strategy in ("ddp", "zero1", "zero2") else (ref,):
        assert summary["memory"][0]["params"] == 4 * summary["n_params"], f"{summary['strategy']} untied the embeddings"
    # and a tied model trains differently from an untied one, so parity means the tie held everywhere
    assert_losses_match(got, ref)


TIED = ("model=hf_llama_tiny", "model.tie_word_embeddings=true", DATA)
CLIP = "trainer.gradient_clip_val=0.05"  # small enough that every step clips: the norm must count the weight once
TIED_CLIPPED = (*TIED, CLIP, "strategy=single,pipeline", "trainer.devices=2")
TIED_TWO = (*TIED, "strategy=single,tensor_parallel,pipeline", "trainer.devices=2")
TIED_FOUR = (*TIED, "strategy=fsdp_tp,3d", "trainer.devices=4")
CHECKPOINTING = {mode: ("model=hf_llama_tiny", "strategy=zero3,pipeline", f"strategy.activation_checkpointing={mode}",
                        "trainer.devices=2", DATA) for mode in ("true", "selective")}
# this module's own sweeps, run one after another in one process when the first is needed (sweeps.together);
# not PARITY_TWO, whose single-device Llama test_chunked_loss reads too
together(PARITY_FOUR, TIED_CLIPPED, TIED_TWO, TIED_FOUR, *CHECKPOINTING.values())


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("strategy,devices,clip", [
    ("tensor_parallel", 2, False), ("pipeline", 2, False), ("fsdp_tp", 4, False), ("3d", 4, False),
    ("pipeline", 2, True)])
def test_tied_llama_model_parallel_matches_single(strategy, devices, clip):
    """Tied embeddings under every model-parallel layout. Tensor parallelism: one vocabulary-split
    weight for the embedding and the LM head. Pipelines (and 3d): the first and last stage each hold a
    copy, broadcast equal after materialisation, their gradients summed every step, counted once by
    global-norm clipping (``parallel/pipeline/stage_ties.py``)."""
    from tests.sweeps import by_strategy, sweep

    if clip:
        runs = by_strategy(sweep(*TIED_CLIPPED))
    elif devices == 2:
        runs = by_strategy(sweep(*TIED_TWO))
    else:
        runs = {**by_strategy(sweep(*TIED_TWO)), **by_strategy(sweep(*TIED_FOUR))}
    assert runs[strategy]["world_size"] == devices
    assert_losses_match(runs[strategy], runs["single"])


def test_sequence_parallel_refuses_plans_without_norm_entries():
    from lightning_par.models.gpt import GPT, GPTConfig
    from lightning_par.parallel.tensor.tensor_parallel import check_sequence_parallel

    with pytest.raises(ValueError, match="set sequence_parallel=false"):
        check_sequence_parallel(tiny("llama").parallel_plan().tp_plan)
    check_sequence_parallel(GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2)).parallel_plan().tp_plan)


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("mode", ["true", "selective"])
@pytest.mark.parametrize("strategy", ["zero3", "pipeline"])
def test_llama_activation_checkpointing_parity(strategy, mode):
    """Full and selective checkpointing (transformers' own checkpointing, handed the selective policy)."""
    from tests.sweeps import by_strategy, sweep

    got = by_strategy(sweep(*CHECKPOINTING[mode]))[strategy]
    # applied by transformers' own checkpointing, read from its layers (rank 0's under the pipeline)
    (applied,) = got["activation_checkpointing"].items()
    assert applied[0] == ("selective" if mode == "selective" else "full") and applied[1] >= 1, got["activation_checkpointing"]
    assert_losses_match(got, summary_of("hf_llama_tiny", "single"))