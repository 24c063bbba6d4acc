"""The attention backend choice (``model.attn_implementation``, ``lightning_par/models/attention.py``): every name
that runs on CPU computes what ``sdpa`` computes, in our GPT (loss and gradients, with and without activation
checkpointing) and in Hugging Face Llama and Qwen2 (logits, a padding mask too), and really runs its own kernel
(the aten ops seen); the refusals before launch; and the activation bytes the estimator adds for the kernels that
keep the T x T scores, against the bytes autograd saves in a real forward (``saved_tensors_hooks``).

Bounds: fp32, rtol 1e-5 for the loss and the logits (with atol 1e-6), and for each gradient its largest element
difference over its largest element (over 1e-3 of the largest of all for a gradient that is zero but for
rounding: the attention keys' bias). Measured: sdpa_flash is bit-equal to sdpa (torch picks the CPU flash kernel
for sdpa); eager and sdpa_math: the loss equal, the gradients 4.7e-7 apart, the logits at most 1.8e-7 (absolute).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from lightning_par import ConfigError
from lightning_par.costs.activations import attention_kernel, layer_bytes_per_token, scores_bytes
from lightning_par.costs.estimate import estimate
from lightning_par.costs.shape import Shape
from lightning_par.models.attention import (BACKENDS, CPU_NAMES, HF_KEYS, NAMES, attend, check_name, device_refusal,
                                            name_of_hf_key)
from lightning_par.models.gpt import GPT, GPTConfig
from lightning_par.models.module import GPTModule, cross_entropy
from tests.helpers import saved_bytes_of_layer

RTOL, ATOL = 1e-5, 1e-6
FLASH_CPU = "aten._scaled_dot_product_flash_attention_for_cpu"
SOFTMAX = {"aten._softmax", "aten._safe_softmax"}  # eager's; the math path's
B, T = 2, 32


class Ops(TorchDispatchMode):
    """The aten ops run while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def grad_err(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    floor = 1e-3 * max(float(g.abs().max()) for g in ref.values())
    return max(float((grads[n] - g).abs().max()) / max(float(g.abs().max()), floor) for n, g in ref.items())


# --------------------------------------------------------------------------- the vocabulary and the kernels on CPU
def test_vocabulary_one_module_for_both_model_kinds():
    assert NAMES == ("sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "eager")
    assert set(BACKENDS) == {n for n in NAMES if n.startswith("sdpa_")}
    # transformers reads any name containing "flash" as a flash-attn / Hub kernel request: sdpa_flash is sdpa_fa there
    assert all("flash" not in key and "sdpa" in key for name, key in HF_KEYS.items() if name != "eager")
    assert all(name_of_hf_key(HF_KEYS[n]) == n for n in NAMES) and name_of_hf_key(None) == "sdpa"
    from lightning_par.models.hf.causal_lm import ATTENTION

    assert ATTENTION == NAMES and "attn_implementation" in GPTConfig.__dataclass_fields__


@pytest.mark.filterwarnings("ignore:.*(kernel not used|do not support non-zero dropout)")
@pytest.mark.parametrize("name", NAMES)
def test_which_names_run_on_this_cpu(name):
    """A tiny call per name (the check before launch rests on this): CPU runs sdpa, sdpa_flash, sdpa_math and eager;
    the memory-efficient and cuDNN kernels are CUDA's; torch's CPU flash kernel has no dropout."""
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    if name in CPU_NAMES:
        attend(name, q, k, v, is_causal=True).sum().backward()
        assert device_refusal(name, "cpu") is None
    else:
        with pytest.raises(RuntimeError):
            attend(name, q, k, v, is_causal=True)
        assert "CUDA kernel" in device_refusal(name, "cpu")
    if name == "sdpa_flash":
        with pytest.raises(RuntimeError):
            attend(name, q, k, v, is_causal=True, dropout_p=0.1)
        assert "no dropout" in device_refusal(name, "cpu", dropout=0.1)


# --------------------------------------------------------------------------- our GPT
def _gpt_step(name: str, ckpt: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor], set[str], set[str]]:
    """Loss, gradients and the aten ops of forward and of backward of gpt_tiny-like weights (seed 0) under ``name``;
    ``ckpt``: each block under torch.utils.checkpoint (non-reentrant), so backward recomputes its attention."""
    torch.manual_seed(0)
    net = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=T, attn_implementation=name)).train()
    x = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1))
    fwd, bwd = Ops(), Ops()
    with fwd:
        h = net.embed(x)
        for block in net.blocks:
            h = checkpoint(block, h, use_reentrant=False) if ckpt else block(h)
        loss = cross_entropy(net.head(h), x)
    with bwd:
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in net.named_parameters()}, fwd.seen, bwd.seen


@pytest.fixture(scope="module")
def gpt_sdpa():
    return _gpt_step("sdpa")


@pytest.mark.parametrize("name", [n for n in CPU_NAMES if n != "sdpa"])
def test_gpt_loss_and_gradients_equal_sdpa(name, gpt_sdpa):
    loss, grads, fwd, _ = _gpt_step(name)
    ref_loss, ref_grads, *_ = gpt_sdpa
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert grad_err(grads, ref_grads) <= RTOL
    # each name runs its own kernel (equal results alone would not show the restriction took effect)
    assert (FLASH_CPU in fwd) == (name == "sdpa_flash") and bool(SOFTMAX & fwd) == (name != "sdpa_flash")


@pytest.mark.parametrize("name", ["sdpa_flash", "sdpa_math"])
def test_gpt_under_activation_checkpointing_recomputes_with_the_same_kernel(name, gpt_sdpa):
    """The restriction is entered inside the attention call, so the recompute in backward picks the same kernel
    (torch picks flash on CPU for plain sdpa: sdpa_math recomputing with flash would show)."""
    loss, grads, _, bwd = _gpt_step(name, ckpt=True)
    ref_loss, ref_grads, *_ = gpt_sdpa
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert grad_err(grads, ref_grads) <= RTOL
    assert (FLASH_CPU in bwd) == (name == "sdpa_flash") and bool(SOFTMAX & bwd) == (name == "sdpa_math")


def test_gpt_module_takes_the_key_and_declares_it():
    m = GPTModule(preset="gpt_tiny", attn_implementation="eager")
    assert m.config.attn_implementation == "eager"
    assert m.build_net("meta").blocks[0].attn.attn_implementation == "eager"
    assert Shape.of_model(m).attn_implementation == "eager" and m.cost_shape()["attn_implementation"] == "eager"
    assert GPTModule(preset="gpt_tiny").config.attn_implementation == "sdpa"


# --------------------------------------------------------------------------- Hugging Face Llama and Qwen2
def _hf(arch: str, name: str):
    from lightning_par.models.hf.causal_lm import HFCausalLM

    m = HFCausalLM(arch=arch, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256, max_positions=T,
                   attn_implementation=name)
    m.configure_model()  # seeded from the global seed: the same weights under every name
    return m


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_logits_equal_sdpa_under_each_cpu_name(arch):
    x = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(2))
    pad = torch.ones(B, T, dtype=torch.long)
    pad[0, :5] = 0  # left padding: the mask transformers builds (sdpa's mask function for every sdpa_* name)
    with torch.no_grad():
        ref = _hf(arch, "sdpa")
        ref_logits, ref_padded = ref(x), ref.net(input_ids=x, attention_mask=pad, use_cache=False).logits
        for name in CPU_NAMES[1:]:
            m = _hf(arch, name)
            assert m.hf_config._attn_implementation == HF_KEYS[name] and m.attn_implementation == name
            ops = Ops()
            with ops:
                logits = m(x)
            torch.testing.assert_close(logits, ref_logits, rtol=RTOL, atol=ATOL)
            padded = m.net(input_ids=x, attention_mask=pad, use_cache=False).logits
            torch.testing.assert_close(padded[0, 5:], ref_padded[0, 5:], rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(padded[1], ref_padded[1], rtol=RTOL, atol=ATOL)
            assert (FLASH_CPU in ops.seen) == (name == "sdpa_flash"), (name, sorted(ops.seen))


def test_hf_pretrained_takes_the_names(tmp_path):
    """A ``save_pretrained`` directory (``model.pretrained``): the config read from it gets transformers' key."""
    from lightning_par.models.hf.causal_lm import HFCausalLM

    ref = _hf("llama", "sdpa")
    ref.net.save_pretrained(tmp_path)
    x = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(x)
        for name in ("sdpa_flash", "sdpa_math"):
            m = HFCausalLM(pretrained=str(tmp_path), attn_implementation=name)
            m.configure_model()
            assert m.hf_config._attn_implementation == HF_KEYS[name] and m.attn_implementation == name
            torch.testing.assert_close(m(x), want, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="attn_implementation='flash'; choose one of"):
        HFCausalLM(pretrained=str(tmp_path), attn_implementation="flash")


# --------------------------------------------------------------------------- refusals
def test_refusals_are_one_line(tmp_path):
    from lightning_par.models.hf.causal_lm import HFCausalLM
    from lightning_par.run.attention_option import check_attention

    with pytest.raises(ValueError, match="attn_implementation='flash' is not an attention implementation"):
        check_name("flash")
    with pytest.raises(ValueError, match="GPTConfig: attn_implementation='flash'"):
        GPTModule(preset="gpt_tiny", attn_implementation="flash")
    with pytest.raises(ValueError, match="attn_implementation='flash'; choose one of sdpa, sdpa_flash"):
        HFCausalLM(attn_implementation="flash")
    # a family without SDPA (Gemma-2: soft-capping) gets eager only, whichever sdpa_* is asked for
    for name in ("sdpa", "sdpa_flash", "sdpa_math"):
        refusal = rf"^HFCausalLM: gemma2 does not support attn_implementation={name}; use eager$"
        with pytest.raises(ValueError, match=refusal):
            HFCausalLM(arch="gemma2", hidden=64, heads=4, layers=1, attn_implementation=name)
    for name in ("sdpa_efficient", "sdpa_cudnn"):
        for model in (GPTModule(preset="gpt_tiny", attn_implementation=name), HFCausalLM(attn_implementation=name)):
            refusal = f"model.attn_implementation={name} cannot run on cpu: .*CUDA kernel"
            with pytest.raises(ConfigError, match=refusal) as e:
                check_attention(model, "cpu", "32-true")
            assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="CPU flash kernel has no dropout"):
        check_attention(GPTModule(preset="gpt_tiny", attn_implementation="sdpa_flash", dropout=0.1), "cpu", "32-true")
    for name in CPU_NAMES:
        check_attention(GPTModule(preset="gpt_tiny", attn_implementation=name), "cpu", "bf16-mixed")
    # CUDA, from the device's compute capability and the run's compute dtype (no GPU here: the rule itself)
    assert "capability 8.0" in device_refusal("sdpa_flash", "cuda", compute_dtype=torch.bfloat16, capability=(7, 5))
    assert device_refusal("sdpa_flash", "cuda", compute_dtype=torch.bfloat16, capability=(8, 0)) is None
    assert "fp16/bf16" in device_refusal("sdpa_flash", "cuda", compute_dtype=torch.float32, capability=(9, 0))
    assert "capability 8.0" in device_refusal("sdpa_cudnn", "cuda", compute_dtype=torch.float16, capability=(7, 0))
    assert device_refusal("sdpa_efficient", "cuda", compute_dtype=torch.float32, capability=(7, 0)) is None
    assert device_refusal("sdpa_efficient", "cuda", compute_dtype=torch.bfloat16, capability=(7, 0))


def test_the_app_refuses_before_launch(tmp_path):
    """``train.validate`` (what the launch runs before any process starts) refuses a CUDA kernel on CPU."""
    from lightning_par.run.train import build, validate
    from tests.helpers import composed

    cfg = composed("experiment=quick", "model.attn_implementation=sdpa_efficient", "trainer.accelerator=cpu",
                   tmp=tmp_path)
    parts = build(cfg)
    with pytest.raises(ConfigError, match="model.attn_implementation=sdpa_efficient cannot run on cpu"):
        validate(cfg, parts["strategy"], parts["model"], parts["datamodule"])


# --------------------------------------------------------------------------- costs
def rule(name: str, precision: str, *, h: int, a: int, kv: int, s: int, dropout: float = 0.0,
         gpt2: bool = False) -> float:
    """What ``name`` saves per token and layer beyond the fused kernel (which keeps q, k and v at their width, the
    output and a 4-byte logsumexp per head), on CPU -- the rule docs/strategies.md states, written out here on its
    own: the s x s tensors per head (eager: the softmax output in fp32 -- in the compute dtype for GPT-2's own eager
    outside autocast -- plus its cast back to the compute dtype; math: fp32 softmax; with dropout the mask and the
    dropped probabilities), k and v repeated to h wide (grouped-query), and the math path's fp32 q, k, v."""
    c = 2 if precision.startswith("bf16") else 4
    autocast = precision == "bf16-mixed"
    if name == "eager":
        p = c if gpt2 and not autocast else 4
        per_score = p + c + c if dropout else p + (c if p != c else 0)
        qkv = c * 2 * (h - kv)  # k and v repeated to h (a Hugging Face model's repeat_kv)
    else:  # sdpa_math: torch upcasts 16-bit q, k, v to fp32
        per_score = 4 + (4 + 4 if dropout else 0)
        qkv = 12 * h - c * (h + 2 * kv)
    return per_score * a * s + qkv - 4 * a


@pytest.mark.parametrize("precision,dropout", [("32-true", 0.0), ("bf16-true", 0.0), ("bf16-mixed", 0.0),
                                               ("bf16-true", 0.1)])
def test_gpt_estimator_adds_the_measured_scores_bytes(precision, dropout):
    """eager and sdpa_math against sdpa: the estimator's layer bytes and its whole activation figure exceed sdpa's by
    the rule, and so do the bytes autograd saves in a real forward of a layer. (With dropout ``sdpa`` takes the
    math path on CPU itself: the rule is then against sdpa_math.)"""
    h, a, L = 64, 4, 2
    x = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(3))

    def measured(name: str) -> tuple[int, float, int]:
        torch.manual_seed(0)
        cfg = GPTConfig(n_layer=L, n_head=a, n_embd=h, block_size=T, dropout=dropout, attn_implementation=name)
        net = GPT(cfg).train()
        if precision == "bf16-true":
            net = net.to(torch.bfloat16)
        shape = Shape.of_gpt(cfg, T)
        est = estimate(shape, devices=1, strategy="single", precision=precision, micro_batch_size=B, device="cpu")
        return (saved_bytes_of_layer(net, net.blocks[1], x, precision), layer_bytes_per_token(shape, precision, device="cpu"),
                est.activations)

    base_name = "sdpa_math" if dropout else "sdpa"
    base = measured(base_name)
    for name in ("eager", "sdpa_math"):
        if name == base_name:
            continue
        got = measured(name)
        want = rule(name, precision, h=h, a=a, kv=h, s=T, dropout=dropout)
        if dropout:
            want -= rule("sdpa_math", precision, h=h, a=a, kv=h, s=T, dropout=dropout)
        assert got[0] - base[0] == want * B * T, (name, got[0] - base[0], want * B * T)  # measured
        assert got[1] - base[1] == want  # the estimator's layer formula
        assert got[2] - base[2] == L * want * B * T  # and its whole activation figure
    assert attention_kernel(Shape(2, h, a, 256, T, attn_implementation="eager"), "cpu") == "eager"
    assert scores_bytes(Shape(2, h, a, 256, T, attn_implementation="sdpa_flash"), precision, device="cpu") == 0


@pytest.mark.parametrize("arch,kv,precision", [("llama", 2, "32-true"), ("llama", 2, "bf16-mixed"),
                                               ("gpt2", 4, "bf16-true")])
def test_hf_estimator_matches_saved_bytes_for_eager_and_math(arch, kv, precision):
    """A Hugging Face decoder layer's saved bytes under eager and sdpa_math minus under sdpa: the rule (grouped-query
    k and v repeated to h; GPT-2's eager softmax in the compute dtype), measured and estimated alike."""
    from lightning_par.models.hf.causal_lm import LogitsOnly, _transformers, hf_config

    h, a = 64, 4
    x = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(4))

    def measured(name: str) -> tuple[int, float]:
        cfg = hf_config(arch, hidden=h, layers=2, heads=a, kv_heads=kv if arch != "gpt2" else None,
                        intermediate=128 if arch != "gpt2" else 256, vocab=256, max_positions=T,
                        tie_word_embeddings=False, attn_implementation=name)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net = LogitsOnly(_transformers().AutoModelForCausalLM.from_config(
                cfg, attn_implementation=cfg._attn_implementation)).train()
        if precision == "bf16-true":
            net = net.to(torch.bfloat16)
        layers = net.net.model.layers if arch != "gpt2" else net.net.transformer.h
        return saved_bytes_of_layer(net, layers[1], x, precision), layer_bytes_per_token(Shape.of_hf(cfg, T), precision,
                                                                              device="cpu")

    base = measured("sdpa")
    for name in ("eager", "sdpa_math"):
        got = measured(name)
        want = rule(name, precision, h=h, a=a, kv=kv * h // a, s=T, gpt2=arch == "gpt2")
        assert got[0] - base[0] == want * B * T, (name, got[0] - base[0], want * B * T)
        assert got[1] - base[1] == want, (name, got[1] - base[1], want)
