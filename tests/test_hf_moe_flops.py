"""The throughput callback's FLOP count for Hugging Face MoE models (``parallel/hf/flops.py``).

The count runs on a meta copy, which transformers' default experts implementation (``grouped_mm``:
bf16-only meta kernel) and eager (``nonzero``) cannot run; the copy's experts are switched to
``batched_mm``, so the count is the routed work. Checked here, in process, on tiny Mixtral, Qwen2-MoE
(with a shared expert) and Qwen3-MoE checkpoints loaded through ``model=hf_causal_lm``'s module:
the count equals an analytic count of the matmuls -- attention projections and scores, the router,
top_k experts per token, the shared expert and its gate, the LM head; forward x 3 for training --
to 1e-6 relative (torch's FLOP counter counts matmuls only and the analytic count lists exactly
those, so the two agree to the FLOP; the tolerance only absorbs rounding), while the same count with
every expert on every token is far outside it. The training model keeps its own implementation.

A model that still cannot be counted never stops the run: MFU is null and ``mfu_note`` says why in
one line -- a family whose experts bypass transformers' dispatch (Llama-4's experts take every token:
counting them would count all experts), or a forward the meta device cannot run.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_par.callbacks.summary import format_summary
from lightning_par.callbacks.throughput import ThroughputMonitor, count_model_flops
from lightning_par.models.hf.causal_lm import HFCausalLM, LogitsOnly

BATCH, SEQ = 2, 16
REL = 1e-6  # the counter and the analytic count both count exactly the matmuls


def _mixtral():  # noqa: ANN202
    from transformers import MixtralConfig

    cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=64)
    return cfg, dict(experts=8, top_k=2, expert_inner=96, shared_inner=0)


def _qwen2_moe():  # noqa: ANN202
    from transformers import Qwen2MoeConfig

    cfg = Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                         shared_expert_intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
    return cfg, dict(experts=8, top_k=2, expert_inner=48, shared_inner=80)


def _qwen3_moe():  # noqa: ANN202
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=3, max_position_embeddings=64)
    return cfg, dict(experts=8, top_k=3, expert_inner=48, shared_inner=0)


def analytic_training_flops(cfg, *, experts, top_k, expert_inner, shared_inner, per_token=None) -> int:  # noqa: ANN001
    """Forward + backward FLOPs of one (BATCH, SEQ) batch, written out from the config: 2 FLOPs per
    multiply-add, the backward twice the forward. ``per_token``: experts run per token (top_k)."""
    h, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    per_token = top_k if per_token is None else per_token
    attention = h * heads * hd + 2 * h * kv * hd + heads * hd * h  # q, k, v, o projections
    router = h * experts
    routed = per_token * 3 * h * expert_inner  # gate, up, down of each expert the token goes through
    shared = (3 * h * shared_inner + h) if shared_inner else 0  # the shared expert and its sigmoid gate
    macs_per_token = layers * (attention + router + routed + shared) + h * vocab  # + the LM head
    tokens = BATCH * SEQ
    scores = layers * 2 * (2 * BATCH * heads * SEQ * SEQ * hd)  # q @ k^T and p @ v, the whole T x T
    return 3 * (2 * macs_per_token * tokens + scores)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object, dict]]:
    from transformers import AutoModelForCausalLM

    out = {}
    for name, make in (("mixtral", _mixtral), ("qwen2_moe", _qwen2_moe), ("qwen3_moe", _qwen3_moe)):
        cfg, sizes = make()
        path = tmp_path_factory.mktemp("moe_flops") / name
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
        out[name] = (path, cfg, sizes)
    return out


@pytest.mark.parametrize("arch,experts_implementation", [("mixtral", None), ("mixtral", "eager"),
                                                         ("qwen2_moe", None), ("qwen3_moe", None)])
def test_the_count_is_the_routed_work(checkpoints, arch: str, experts_implementation: str | None) -> None:
    path, cfg, sizes = checkpoints[arch]
    config = {"_experts_implementation": experts_implementation} if experts_implementation else None
    module = HFCausalLM(pretrained=str(path), seq_len=SEQ, config=config)
    before = module.hf_config._experts_implementation
    assert before == (experts_implementation or "grouped_mm")  # what the training model runs (and crashed on meta)

    flops, note = count_model_flops(module, BATCH)

    assert note is None, note
    routed = analytic_training_flops(cfg, **sizes)
    dense = analytic_training_flops(cfg, **sizes, per_token=sizes["experts"])
    assert flops == pytest.approx(routed, rel=REL), (flops, routed)
    assert abs(dense - routed) > 10 * REL * routed  # all experts on every token would be far outside the tolerance
    # only the counting copy was switched: the model trained keeps its implementation
    assert module.hf_config._experts_implementation == before
    experts = [m for m in module.build_hf("meta").modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(m.config._experts_implementation == before for m in experts)


def test_the_monitor_reports_the_count_and_no_note(checkpoints) -> None:
    path, cfg, sizes = checkpoints["mixtral"]
    monitor = ThroughputMonitor()
    monitor.on_train_start(_trainer(), HFCausalLM(pretrained=str(path), seq_len=SEQ))
    assert monitor.flops_per_step == pytest.approx(analytic_training_flops(cfg, **sizes), rel=REL)
    assert "mfu_note" not in monitor.summary()


def test_a_users_moe_measured_on_a_step_is_left_uncounted_with_a_note(checkpoints) -> None:
    """A module of the user's own (no meta-copy protocol) is measured on a real step with torch's
    FlopCounterMode, which has no formula for transformers' grouped experts: not counted, a note says why."""
    from transformers import AutoModelForCausalLM

    path, _, _ = checkpoints["mixtral"]
    holder = nn.Module()
    holder.lm = AutoModelForCausalLM.from_pretrained(path)
    monitor = ThroughputMonitor(peak_tflops=100.0)
    monitor.on_train_start(SimpleNamespace(datamodule=SimpleNamespace(global_batch_size=BATCH), global_step=0,
                                           callbacks=[]), holder)
    assert monitor.flops_per_step is None and not monitor._measure_pending
    note = monitor.flops_note
    assert note.startswith("FLOPs not counted: Module routes tokens through transformers' experts ") and \
        "grouped matmuls" in note and "\n" not in note, note


class _Holder:
    """A LightningModule's side of the count: a meta copy and an example batch."""

    def __init__(self, build) -> None:  # noqa: ANN001
        self.build = build

    def build_net(self, device: str = "meta") -> nn.Module:
        with torch.device(device):
            return self.build()

    def example_input(self, batch_size: int, device: str = "meta") -> torch.Tensor:
        return torch.zeros(batch_size, SEQ, dtype=torch.long, device=device)


def _trainer() -> SimpleNamespace:
    return SimpleNamespace(datamodule=SimpleNamespace(global_batch_size=BATCH))


def _llama4() -> nn.Module:
    from transformers import AutoModelForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(vocab_size=256, hidden_size=64, intermediate_size=96, intermediate_size_mlp=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_local_experts=4, num_experts_per_tok=1, max_position_embeddings=64, use_cache=False)
    return LogitsOnly(AutoModelForCausalLM.from_config(cfg))


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb(x[torch.nonzero(x >= 0, as_tuple=True)])  # nonzero: no meta kernel


@pytest.mark.parametrize("build,why", [(_llama4, "Llama4TextExperts at net.model.layers.0.feed_forward.experts"),
                                       (_DataDependent, "NotImplementedError")], ids=["llama4", "nonzero"])
def test_a_model_that_cannot_be_counted_has_null_mfu_and_a_reason(build, why: str) -> None:
    monitor = ThroughputMonitor(peak_tflops=100.0)
    monitor.peak_flops_per_rank = 100e12  # a known peak: MFU is null because of the count alone
    monitor.on_train_start(_trainer(), _Holder(build))  # does not raise
    assert monitor.flops_per_step is None
    monitor.windows = [(1, 1, 0.5)]
    s = monitor.summary()
    assert s["mfu"] is None and s["flops_per_step"] is None
    note = s["mfu_note"]
    assert note.startswith("FLOPs not counted: ") and why in note and "\n" not in note, note
    printed = format_summary({"strategy": "single", "world_size": 1, "mesh": {}, "model": "m", "n_params": 1,
                              "precision": "32-true", "steps": 1, "losses": [1.0], "final_loss": 1.0,
                              "global_batch_size": BATCH, **s})
    assert f"MFU n/a: {note}" in printed.splitlines()


def test_the_memory_trace_of_an_moe_logs_no_error(checkpoints) -> None:
    """The pre-launch memory check traces the model on fake tensors; transformers' grouped_mm cannot run
    there, and torch logged that as an ERROR with a traceback (its own stderr handler: the logger does
    not propagate) before the trace fell back to real CPU steps -- on every run of an HF MoE. The
    fallback is the design; the ERROR is not shown."""
    import logging

    from lightning_par.costs.traced import trace_model

    records: list[logging.LogRecord] = []
    catch = logging.Handler()
    catch.emit = records.append  # type: ignore[method-assign]
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.addHandler(catch)
    try:
        path, _, _ = checkpoints["mixtral"]
        traced = trace_model(lambda: HFCausalLM(pretrained=str(path), seq_len=SEQ), 2)
    finally:
        fake_log.removeHandler(catch)
    assert traced.peak > 0
    assert not [r for r in records if r.levelno >= logging.ERROR], [r.getMessage() for r in records]
    assert fake_log.level == level  # put back as it was
