"""The ``moe`` run summary for Hugging Face MoE models (``callbacks/moe.py``'s ``HFExpertCounts``).

In process, on a tiny Mixtral built from its config: a training forward adds, per experts module,
the bincount of the router's own top-k choices (summing to tokens x top_k); eval and ``no_grad``
forwards and the recompute of activation checkpointing add nothing; a pipeline finds the counters
(``forward_stats_sources``) and keeps only its micro-batches' forwards; the monitor's summary has
them by full module path, and its hooks end with the run.

End to end: ``run.py`` on a 2-layer Mixtral checkpoint (4 experts, top-2) at 2 ranks, under
expert_parallel and under pipeline, both with activation checkpointing: every step's tokens per
expert of every layer sum to the global batch's tokens x top_k (a pipeline's shape-inference forward
on its first step and the recomputes not counted; the two stages' layers gathered by name).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from lightning_par.callbacks.moe import HFExpertCounts, MoEMonitor
from lightning_par.parallel.contract import STATS_ATTR, forward_stats_sources
from lightning_par.parallel.hf.plan import hf_enable_checkpointing
from tests.sweeps import sweep

TOP_K, EXPERTS = 2, 4
NAMES = ["net.model.layers.0.mlp.experts", "net.model.layers.1.mlp.experts"]


def _mixtral_config(vocab: int = 64):  # noqa: ANN202
    from transformers import MixtralConfig

    return MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                         vocab_size=vocab, max_position_embeddings=128)


class _Holder(nn.Module):
    """What a LightningModule holding a Hugging Face model looks like to the monitor."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import MixtralForCausalLM

        torch.manual_seed(0)
        self.net = MixtralForCausalLM(_mixtral_config())


def _started() -> tuple[_Holder, MoEMonitor, SimpleNamespace]:
    holder, monitor = _Holder(), MoEMonitor()
    trainer = SimpleNamespace(global_step=0, world_size=1, strategy=SimpleNamespace())
    monitor.on_train_start(trainer, holder)
    return holder, monitor, trainer


def _routes(holder: _Holder) -> list[list[torch.Tensor]]:
    """Per layer, the top-k expert indices of every call of its router (MixtralTopKRouter's third output)."""
    seen: list[list[torch.Tensor]] = [[] for _ in holder.net.model.layers]
    for i, layer in enumerate(holder.net.model.layers):
        layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out[2].detach().clone()))
    return seen


def _counts(monitor: MoEMonitor) -> list[torch.Tensor | None]:
    return [s["tokens_per_expert"].clone() if s else None for s in (m.last_stats for m in monitor._layers)]


def test_a_training_forward_counts_the_routers_choices_once() -> None:
    holder, monitor, _ = _started()
    assert monitor._names == NAMES and all(isinstance(m, HFExpertCounts) for m in monitor._layers)
    assert monitor._moe_model
    routes = _routes(holder)
    assert hf_enable_checkpointing(holder.net)  # transformers' own (non-reentrant): recomputed in backward
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    holder.train()
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recompute the whole layer, hooks included
        holder.net(input_ids=ids, use_cache=False).logits.float().sum().backward()
    assert [len(r) for r in routes] == [2, 2]  # forward + the checkpoint's recompute
    got = _counts(monitor)
    for layer, (counts, calls) in enumerate(zip(got, routes)):
        assert counts.dtype == torch.long and counts.shape == (EXPERTS,)
        assert int(counts.sum()) == 3 * 16 * TOP_K, layer
        assert torch.equal(counts, torch.bincount(calls[0].flatten(), minlength=EXPERTS)), layer
    stats = monitor._layers[0].last_stats
    assert int(stats["dropped"]) == 0 and stats["a2a_bytes"] == 0 and stats["assignments"] == 3 * 16 * TOP_K

    with torch.no_grad():  # in training mode, without gradients
        holder.net(input_ids=ids, use_cache=False)
    holder.eval()
    holder.net(input_ids=ids, use_cache=False)  # eval mode, with gradients
    with torch.no_grad():
        holder.net(input_ids=ids, use_cache=False)
    assert [len(r) for r in routes] == [5, 5]  # the router ran; nothing was counted
    assert all(torch.equal(a, b) for a, b in zip(_counts(monitor), got))


def test_pipeline_keeps_micro_batches_and_the_monitor_sums_by_path() -> None:
    holder, monitor, trainer = _started()
    sources = forward_stats_sources([holder])  # what a pipeline clears and trims around each step
    assert sources == monitor._layers
    routes = _routes(holder)
    holder.train()
    g = torch.Generator().manual_seed(2)
    for _ in range(3):  # e.g. a stage's shape inference, then two micro-batches
        holder.net(input_ids=torch.randint(0, 64, (2, 8), generator=g), use_cache=False)
    for m in sources:
        m.keep_last_forwards(2)
    want = [torch.bincount(torch.cat(r[1:]).flatten(), minlength=EXPERTS) for r in routes]
    assert all(torch.equal(a, b) for a, b in zip(_counts(monitor), want))

    trainer.global_step = 1  # the optimizer step ended with this batch
    monitor.on_train_batch_end(trainer, holder, None, None, 0)
    assert _counts(monitor) == [None, None]  # read and cleared
    monitor.on_train_end(trainer, holder)
    moe = monitor.summary()["moe"]
    assert moe["n_layers"] == 2 and moe["n_experts"] == EXPERTS and moe["dropped_fraction"] == 0.0
    assert moe["tokens_per_expert"] == [[w.tolist() for w in want]]
    # the hooks ended with the run: no attribute left, and a training forward goes uncounted
    mod = holder.net.model.layers[0].mlp.experts
    assert not hasattr(mod, STATS_ATTR) and forward_stats_sources([holder]) == []
    holder.net(input_ids=torch.randint(0, 64, (2, 8)), use_cache=False)
    assert _counts(monitor) == [None, None]


# ------------------------------------------------------------------------------ end to end, 2 ranks
GLOBAL_BATCH, SEQ = 8, 64  # experiment=quick's global batch and sequence length


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import MixtralForCausalLM

    out = tmp_path_factory.mktemp("hf_moe") / "mixtral"
    torch.manual_seed(0)
    MixtralForCausalLM(_mixtral_config(vocab=256)).save_pretrained(out)  # vocab 256: the byte-level text data
    return out


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_rank_runs_write_the_moe_summary(mixtral_dir: Path) -> None:
    runs = {s["strategy"]: s for s in sweep("model=hf_causal_lm", f"model.pretrained={mixtral_dir}",
                                            "strategy=expert_parallel,pipeline", "trainer.devices=2",
                                            "strategy.activation_checkpointing=true",
                                            timeout=360)}
    assert runs["expert_parallel"]["mesh"] == {"ep": 2} and runs["pipeline"]["mesh"] == {"pp": 2}
    for strategy, s in runs.items():
        moe = s["moe"]
        assert moe["n_layers"] == 2 and moe["n_experts"] == EXPERTS and moe["dropped_fraction"] == 0.0, strategy
        assert len(moe["tokens_per_expert"]) == len(s["losses"]) == 12, strategy
        for step, layers in enumerate(moe["tokens_per_expert"], 1):
            assert [sum(c) for c in layers] == [GLOBAL_BATCH * SEQ * TOP_K] * 2, (strategy, step, layers)
        assert all(b >= 1.0 for b in moe["load_balance_max_over_mean"]), strategy
        # the throughput callback counts the routed FLOPs of a transformers MoE (tests/test_hf_moe_flops.py)
        assert s["flops_per_step"] and "mfu_note" not in s, (strategy, s.get("mfu_note"))
    assert runs["expert_parallel"]["moe"]["all_to_all_bytes_per_step"] > 0
    assert runs["pipeline"]["moe"]["all_to_all_bytes_per_step"] == 0
