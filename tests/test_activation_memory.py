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

from lightning_par.costs.activations import Shape, attention_kernel
from lightning_par.estimate import estimate
from lightning_par.models.gpt import GPT
from lightning_par.parallel.checkpointing import apply_activation_checkpointing
from tests.helpers import memtracker_step_peak

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
}


def measured_peak(shape: Shape, batch: int, precision: str, checkpointing: bool) -> int:
    torch.manual_seed(0)
    net = GPT(shape.gpt_config()).train()
    if checkpointing:
        apply_activation_checkpointing(net, blocks=[f"blocks.{i}" for i in range(shape.n_layer)])
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
    assert {c[6] for c in CASES.values()} == {"32-true", "bf16-mixed"} and {c[7] for c in CASES.values()} == {True, False}
    assert {attention_kernel(s, "cpu") for s in shapes} == {"fused", "math"}
