"""Selective activation checkpointing (``strategy.activation_checkpointing=selective``; issue 31): each
block keeps its matmul and fused-attention outputs and recomputes the rest (parallel/memory/checkpointing.py).

- In one process: the gradients equal those without checkpointing and with full checkpointing, bit for
  bit (fp32: recomputation repeats the same arithmetic), for our GPT and a transformers Llama (through
  transformers' own checkpointing, handed the policy); the activations it keeps after forward (MemTracker)
  lie between full checkpointing's and none's.
- Through the app at 2 ranks (every data-parallel strategy, tensor parallel, pipeline) and at 4 (zero3, fsdp,
  hsdp): the losses of the single-device run (fp32, gloo, 12 AdamW steps, rtol 1e-5: recomputation does not
  change fp32 results), and summary.json's ``activation_checkpointing`` -- read from the modules -- shows the
  blocks checkpointed selectively (losses alone would pass if the option were dropped). The Hugging Face
  Llama under zero3 and pipeline is in test_hf.py.
- Every k-th block (``activation_checkpointing=k``): exact gradients in one process (ours and transformers'
  own switch), and at 2 ranks under fsdp and the pipeline the single-device losses.
- A value other than false / true / full / selective / k >= 1 is one line before launch.
The estimator's peak under selective checkpointing is checked against MemTracker in
test_activation_memory.py, the advisor's weighing of it in test_advisor.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_par import ConfigError
from lightning_par.parallel.memory.checkpointing import apply_activation_checkpointing, checkpointing_mode, every_kth
from lightning_par.run.config_values import check_config_values
from tests.helpers import assert_losses_match, composed
from tests.sweeps import by_strategy, single_refs, sweep, together

TWO_RANKS = ("ddp", "zero1", "zero2", "zero3", "fsdp", "zero3_offload", "tensor_parallel", "pipeline")
FOUR_RANKS = ("zero3", "fsdp", "hsdp")


def test_the_option_reads_as_a_mode_and_a_bad_value_is_one_line():
    assert [checkpointing_mode(v) for v in (False, None, "false", True, "true", "full", "selective", 1, 2, "3")] == \
        [None, None, None, "full", "full", "full", "selective", "full", 2, 3]
    for bad in ("sometimes", 0, -2):
        with pytest.raises(ValueError, match="must be false, true, full, selective or k >= 1"):
            checkpointing_mode(bad)
    assert every_kth([f"b{i}" for i in range(5)], 2) == ["b0", "b2", "b4"] and every_kth(["b0", "b1"], "full") == ["b0", "b1"]
    check_config_values(composed("experiment=quick", "strategy=fsdp", "strategy.activation_checkpointing=2"))
    check_config_values(composed("experiment=quick", "strategy=fsdp", "strategy.activation_checkpointing=selective"))
    with pytest.raises(ConfigError) as info:
        check_config_values(composed("experiment=quick", "strategy=fsdp", "strategy.activation_checkpointing=sometimes"))
    assert "\n" not in str(info.value) and str(info.value).startswith("strategy.activation_checkpointing=sometimes")


def _step(net: torch.nn.Module, x: torch.Tensor, mode: str | None, blocks: list[str]) -> tuple[int, list[torch.Tensor]]:
    """(activation bytes alive after forward, the gradients) of one step of a copy of ``net``."""
    from torch.distributed._tools.mem_tracker import MemTracker

    net = copy.deepcopy(net)
    if mode:
        apply_activation_checkpointing(net, blocks=blocks, mode=mode)
    tracker = MemTracker()
    tracker.track_external(net)
    with tracker:
        out = net(x)
        (snapshot,) = tracker.get_tracker_snapshot().values()
    out.float().logsumexp(-1).mean().backward()
    acts = next(v for k, v in snapshot.items() if getattr(k, "name", "") == "ACT")
    return acts, [p.grad for p in net.parameters()]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_gradients_are_exact_and_activations_fall_between_none_and_full(family):
    torch.manual_seed(0)
    if family == "gpt":
        from lightning_par.models.gpt import GPT, GPTConfig

        net = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=64, vocab_size=256, block_size=128))
        blocks = [f"blocks.{i}" for i in range(3)]
    else:
        from transformers import AutoModelForCausalLM, LlamaConfig

        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
        hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()

        class Logits(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = hf

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.net(input_ids=x, use_cache=False).logits

        net, blocks = Logits(), [f"net.model.layers.{i}" for i in range(3)]
    x = torch.randint(0, 256, (4, 128))
    none, grads = _step(net, x, None, blocks)
    full, full_grads = _step(net, x, "full", blocks)
    selective, selective_grads = _step(net, x, "selective", blocks)
    every, every_grads = _step(net, x, "full", every_kth(blocks, 2))  # activation_checkpointing=2: blocks 0 and 2
    assert all(torch.equal(a, b) for a, b in zip(grads, selective_grads))
    assert all(torch.equal(a, b) for a, b in zip(grads, full_grads))
    assert all(torch.equal(a, b) for a, b in zip(grads, every_grads))
    assert full < selective < none, (full, selective, none)
    assert full < every < none, (full, every, none)


def test_through_transformers_own_checkpointing_the_gradients_are_exact():
    """A Hugging Face model is checkpointed by transformers' own switch (parallel/hf/plan.py), given the
    selective policy as torch's ``context_fn``: exact gradients, and after forward less kept than without
    checkpointing, more than with full."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_par.parallel.hf.plan import hf_enable_checkpointing

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    base = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().train()
    x = torch.randint(0, 256, (4, 128))
    grads, kept = {}, {}
    for mode in (None, "full", "selective", 2):
        net = copy.deepcopy(base)
        if mode:
            assert hf_enable_checkpointing(net, mode)
        if mode == 2:  # every 2nd decoder layer: layer 0 of the 2 keeps transformers' checkpointing, layer 1 not
            assert [layer.gradient_checkpointing for layer in net.model.layers] == [True, False]
        tracker = MemTracker()
        tracker.track_external(net)
        with tracker:
            logits = net(input_ids=x, use_cache=False).logits
            (snapshot,) = tracker.get_tracker_snapshot().values()
        kept[mode] = next(v for k, v in snapshot.items() if getattr(k, "name", "") == "ACT")
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        grads[mode] = [p.grad for p in net.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads[None], grads["selective"]))
    assert all(torch.equal(a, b) for a, b in zip(grads[None], grads[2]))
    assert kept["full"] < kept["selective"] < kept[None], kept
    assert kept["full"] < kept[2] < kept[None], kept


#: (ranks, strategies) of the selective-checkpointing sweeps
SWEEPS = {2: TWO_RANKS, 4: FOUR_RANKS}
SELECTIVE = {ranks: (f"strategy={','.join(names)}", f"trainer.devices={ranks}", "strategy.activation_checkpointing=selective")
             for ranks, names in SWEEPS.items()}
EVERY_KTH = ("strategy=fsdp,pipeline", "trainer.devices=2", "strategy.activation_checkpointing=2")
# this module's sweeps, run one after another in one process when the first is needed (sweeps.together)
together(*SELECTIVE.values(), EVERY_KTH)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("ranks,strategy", [(n, s) for n, names in SWEEPS.items() for s in names])
def test_selective_checkpointing_matches_single(ranks, strategy):
    s = by_strategy(sweep(*SELECTIVE[ranks]))[strategy]
    assert s["world_size"] == ranks
    # applied, read from the modules: both blocks of gpt_tiny (rank 0's one under the pipeline)
    assert s["activation_checkpointing"] == {"selective": 1 if strategy == "pipeline" else 2}, s["activation_checkpointing"]
    assert_losses_match(s, single_refs()[0])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_kth_block_matches_single():
    """``activation_checkpointing=2`` at 2 ranks: fsdp checkpoints block 0 of gpt_tiny's two, and so does the
    pipeline's rank 0, whose stage holds block 0 (summary.json reports rank 0's modules); losses: the
    single-device run's (fp32, rtol 1e-5)."""
    s = by_strategy(sweep(*EVERY_KTH))
    for name in ("fsdp", "pipeline"):
        assert s[name]["activation_checkpointing"] == {"full": 1}, (name, s[name]["activation_checkpointing"])
        assert_losses_match(s[name], single_refs()[0])


def test_selective_with_tiled_layers_inside_a_block_is_one_line_before_launch(tmp_path):
    """A tiled layer inside a block is its own FSDP unit and checkpoint: torch's selective checkpointing of
    the block fails in backward ("... not found in storage"), so the combination is refused before any
    step; a tiled head (outside the blocks) is not affected."""
    from lightning_par import cli

    base = ("experiment=quick", "trainer.max_steps=1", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
            "strategy=zero3_offload", "strategy.activation_checkpointing=selective")
    with pytest.raises((ConfigError, ValueError), match=r"^activation_checkpointing=selective cannot checkpoint a block "
                       r"whose layers are tiled \(strategy.tiling: net.blocks.0.mlp.fc, ...\): use "):
        cli._run(composed(*base, "+strategy.tiling={net.blocks.0.mlp.fc:2}", tmp=tmp_path / "inside"))
    cli._run(composed(*base, "+strategy.tiling={net.head.lm_head:2}", tmp=tmp_path / "head"))
    assert (tmp_path / "head" / "summary.json").exists()
