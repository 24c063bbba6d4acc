"""The activation model (lightning_par/costs) against torch's MemTracker on CPU.

One real training step after a warm-up step (the optimizer state exists, as in every step but the
first) of the demo GPT -- the model's own ``loss_fn``, the optimizer factory's AdamW (foreach on
CPU), autocast for bf16-mixed, the repository's per-block checkpointing -- tracked by
``torch.distributed._tools.mem_tracker.MemTracker``; its peak (parameters, gradients, optimizer
state, activations and temporaries together) must be within 15% of ``estimate(...).peak``.
Shapes are tiny but chosen so that every term matters: short and long sequences (s > h), small and
large vocabularies (the loss buffers dominate), with and without checkpointing, fp32 and bf16,
dropout (the math attention path on CPU).
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.costs.activations import attention_kernel
from lightning_par.costs.shape import Shape
from lightning_par.costs.estimate import estimate
from lightning_par.models.gpt import GPT
from lightning_par.parallel.memory.checkpointing import apply_activation_checkpointing, checkpointing_mode, every_kth
from tests.helpers import memtracker_step_peak, saved_bytes_of_layer

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 0.15

# (n_layer, n_embd, n_head, vocab, seq_len, batch, precision, checkpointing, dropout)
CASES = {
    "short-seq-small-vocab-fp32": (2, 64, 4, 256, 32, 8, "32-true", False, 0.0),
    "long-seq-fp32": (2, 32, 2, 256, 256, 2, "32-true", False, 0.0),
    "large-vocab-fp32": (2, 64, 4, 8192, 64, 4, "32-true", False, 0.0),
    "large-vocab-bf16": (2, 64, 4, 8192, 64, 4, "bf16-mixed", False, 0.0),
    "checkpointing-fp32": (4, 64, 4, 256, 128, 4, "32-true", True, 0.0),
    "long-seq-checkpointing-bf16": (4, 32, 2, 512, 256, 2, "bf16-mixed", True, 0.0),
    "dropout-math-path-fp32": (2, 32, 2, 256, 128, 2, "32-true", False, 0.1),
    # selective checkpointing (parallel/memory/checkpointing.py): matmul and fused-attention outputs kept
    "selective-fp32": (4, 64, 4, 256, 128, 4, "32-true", "selective", 0.0),
    "selective-long-seq-bf16": (4, 32, 2, 512, 256, 2, "bf16-mixed", "selective", 0.0),
    "selective-math-path-fp32": (4, 32, 2, 256, 128, 2, "32-true", "selective", 0.1),
    # every 2nd block checkpointed whole (activation_checkpointing=2): blocks 0 and 2 of 4
    "every-2nd-long-seq-fp32": (4, 32, 2, 512, 256, 2, "32-true", 2, 0.0),
}


def _mode(checkpointing: bool | str | int) -> str:
    return "selective" if checkpointing == "selective" else "full"


def measured_peak(shape: Shape, batch: int, precision: str, checkpointing: bool | str | int) -> int:
    torch.manual_seed(0)
    net = GPT(shape.gpt_config()).train()
    if checkpointing:  # the blocks parallelize checkpoints (every_kth: all of them, or every k-th)
        apply_activation_checkpointing(net, blocks=every_kth([f"blocks.{i}" for i in range(shape.n_layer)],
                                                             checkpointing_mode(checkpointing)),
                                       mode=_mode(checkpointing))
    return memtracker_step_peak(net, shape.vocab_size, batch, shape.seq_len, precision)


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_peak_within_15_percent_of_memtracker(case):
    L, h, a, V, T, B, precision, ckpt, dropout = CASES[case]
    shape = Shape(n_layer=L, n_embd=h, n_head=a, vocab_size=V, seq_len=T, dropout=dropout)
    est = estimate(shape, devices=1, strategy="single", precision=precision, optimizer="adamw",
                   micro_batch_size=B, checkpointing=ckpt, device="cpu")
    got = measured_peak(shape, B, precision, ckpt)
    assert abs(est.peak - got) <= TOLERANCE * got, (
        f"{case}: estimated peak {est.peak:,} B ({est.moment}), MemTracker {got:,} B, "
        f"ratio {est.peak / got:.3f}")


def test_the_cases_exercise_every_term():
    """Each term the model has is decisive somewhere: long sequences (s > h), vocabularies whose loss
    buffers outweigh the layers, checkpointing, both dtypes and both attention paths."""
    shapes = [Shape(L, h, a, V, T, dropout=d) for L, h, a, V, T, _, _, _, d in CASES.values()]
    assert any(s.seq_len > s.n_embd for s in shapes)
    assert any(8 * s.vocab_size > 16 * s.n_layer * s.n_embd for s in shapes)  # loss buffers > all layers
    assert {c[6] for c in CASES.values()} == {"32-true", "bf16-mixed"} and {c[7] for c in CASES.values()} == {True, False, "selective", 2}
    assert {attention_kernel(s, "cpu") for s in shapes} == {"fused", "math"}


# ---------------------------------------------------------------------------------------------------
# Hugging Face decoders (models/hf/causal_lm.py): grouped-query attention, gated MLPs, RMSNorm, tied heads

HF_TOLERANCE = 0.10  # measured ratios 0.998-1.064 (checkpointing the highest)


def hf_shape(arch: str, L: int, h: int, a: int, kv: int, f: int, V: int, T: int, tied: bool = False) -> Shape:
    """The shape ``models/hf/causal_lm.py`` builds for these sizes (through the transformers config itself)."""
    from lightning_par.models.hf.causal_lm import hf_config

    cfg = hf_config(arch, hidden=h, layers=L, heads=a, kv_heads=kv if arch != "gpt2" else None, intermediate=f,
                    vocab=V, max_positions=T, tie_word_embeddings=tied)
    return Shape.of_hf(cfg, T)


def hf_net(shape: Shape, checkpointing: bool | str = False) -> torch.nn.Module:
    from lightning_par.models.hf.causal_lm import LogitsOnly, _transformers
    from lightning_par.parallel.hf.plan import hf_blocks

    torch.manual_seed(0)
    cfg = shape.hf_config()
    net = LogitsOnly(_transformers().AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")).train()
    if checkpointing:
        apply_activation_checkpointing(net, blocks=[f"net.{b}" for b in hf_blocks(net.net)], mode=_mode(checkpointing))
    return net


# (arch, n_layer, hidden, heads, kv_heads, mlp_hidden, vocab, seq_len, tied, batch, precision, checkpointing)
HF_CASES = {
    "llama-gqa-4-2-bf16": ("llama", 2, 64, 4, 2, 128, 256, 64, False, 4, "bf16-mixed", False),
    "llama-mqa-long-seq-fp32": ("llama", 2, 32, 4, 1, 96, 256, 256, False, 2, "32-true", False),
    "llama-tied-large-vocab-bf16": ("llama", 2, 64, 4, 2, 128, 8192, 64, True, 4, "bf16-mixed", False),
    "llama-checkpointing-fp32": ("llama", 4, 64, 4, 2, 128, 256, 128, False, 4, "32-true", True),
    "qwen2-bf16": ("qwen2", 2, 64, 4, 2, 128, 256, 64, True, 4, "bf16-mixed", False),
    "gpt2-tied-fp32": ("gpt2", 2, 64, 4, 4, 256, 256, 64, True, 4, "32-true", False),
    "llama-selective-fp32": ("llama", 4, 64, 4, 2, 128, 256, 128, False, 4, "32-true", "selective"),
    "gpt2-selective-bf16": ("gpt2", 4, 64, 4, 4, 256, 256, 128, True, 4, "bf16-mixed", "selective"),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_estimate_peak_within_10_percent_of_memtracker(case):
    """The estimator's peak for a Hugging Face decoder (its op-by-op shape, not a trace) against
    MemTracker on one real CPU step of the transformers model itself."""
    arch, L, h, a, kv, f, V, T, tied, B, precision, ckpt = HF_CASES[case]
    shape = hf_shape(arch, L, h, a, kv, f, V, T, tied)
    est = estimate(shape, devices=1, strategy="single", precision=precision, optimizer="adamw",
                   micro_batch_size=B, checkpointing=ckpt, device="cpu")
    got = memtracker_step_peak(hf_net(shape, ckpt), V, B, T, precision)
    assert abs(est.peak - got) <= HF_TOLERANCE * got, (
        f"{case}: estimated peak {est.peak:,} B ({est.moment}), MemTracker {got:,} B, ratio {est.peak / got:.3f}")


@pytest.mark.parametrize("arch,kv,precision", [("llama", 2, "32-true"), ("llama", 2, "bf16-mixed"),
                                               ("llama", 1, "bf16-true"), ("qwen2", 2, "bf16-mixed"),
                                               ("gpt2", 4, "32-true"), ("gpt2", 4, "bf16-mixed")])
def test_hf_layer_saves_what_the_estimator_counts(arch, kv, precision):
    """A decoder layer's saved tensors, to the byte: the RMSNorm statistics, one autocast copy of a
    norm's output per linear reading it, k and v at the key/value heads' width, the gated MLP's four
    inner tensors (GPT-2: the fused qkv and gelu_new's Python ops) -- ``hf_layer_bytes_per_token``
    times the tokens, plus autocast's copies of the layer's weights."""
    from lightning_par.costs.activations import layer_bytes_per_token, weight_copy_bytes

    B, T = 2, 64
    shape = hf_shape(arch, 2, 64, 4, kv, 128 if arch != "gpt2" else 256, 256, T)
    net = hf_net(shape)
    if precision == "bf16-true":
        net = net.to(torch.bfloat16)
    layers = net.net.model.layers if arch != "gpt2" else net.net.transformer.h
    got = saved_bytes_of_layer(net, layers[1], torch.randint(0, 256, (B, T)), precision)
    want = layer_bytes_per_token(shape, precision, device="cpu") * B * T + weight_copy_bytes(
        shape.units()["block_matmul"], precision)
    assert got == want, f"{arch} kv={kv} {precision}: saved {got:,} B, estimated {want:,.0f} B"
