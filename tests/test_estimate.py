"""The memory model: the ZeRO paper's figures, byte layouts, transient peaks, every strategy declared,
``mode=estimate``'s table and estimate.json, the CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_par.models.build import instantiate_model
from lightning_par.costs.activations import in_flight_micro_batches
from lightning_par.costs.peak import step_peak, zero2_staged
from lightning_par.costs.shape import Shape
from lightning_par.costs.states import optimizer_state_bytes
from lightning_par.costs.estimate import (
    STRATEGIES,
    bytes_per_param,
    estimate,
    estimate_all,
    estimate_table,
    layout,
    model_shape,
)
from lightning_par.models.gpt import PRESETS, GPTConfig
from lightning_par.modes.estimate import main

from tests import launch

ROOT = Path(__file__).resolve().parents[1]


def _gb(x: float) -> float:
    return float(f"{x / 1e9:.3g}")  # 3 significant digits, GB = 1e9 bytes as in the paper


def test_zero_paper_figure_1() -> None:
    """Ψ = 7.5B, N = 64, K = 12 (Rajbhandari et al. 2020, Figure 1): the model states per rank."""
    got = {s: _gb(estimate(7.5e9, devices=64, strategy=s, precision="paper-mixed").states)
           for s in ("ddp", "zero1", "zero2", "zero3")}
    assert got == {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.88}
    assert bytes_per_param("paper-mixed", "adamw") == (2, 2, 12)


def test_stage_ordering_and_offload() -> None:
    rows = {r.strategy: r for r in estimate_all(1e9, devices=8, precision="bf16-mixed")}
    states = [rows[s].states for s in ("ddp", "zero1", "zero2", "zero3")]
    assert states == sorted(states, reverse=True) and len(set(states)) == 4
    assert rows["fsdp"].peak == rows["zero3"].peak
    off = rows["zero3_offload"]
    assert (off.params, off.grads, off.optimizer_state, off.peak) == (0, 0, 0, 0)
    assert off.offloaded == rows["zero3"].states
    assert rows["zero1"].params == rows["ddp"].params and rows["zero1"].grads == rows["ddp"].grads
    assert rows["zero2"].params == rows["ddp"].params and rows["zero2"].grads == rows["ddp"].grads // 8
    assert rows["zero3"].params == rows["ddp"].params // 8


def test_zero2_reduces_in_buckets_and_peaks_below_zero1() -> None:
    """zero2 reduce-scatters gradients bucket by bucket during backward, so full gradients never exist:
    its transient is three 25 MiB buckets (two in flight, one filling), and it peaks below zero1, which
    holds every gradient in DDP's buckets."""
    r = estimate(1e9, devices=8, strategy="zero2", precision="bf16-mixed")
    assert r.grads == 4 * 10**9 // 8 and r.transient == 3 * 25 * 2**20 and r.peak == r.states + r.transient
    assert r.peak < estimate(1e9, devices=8, strategy="zero1", precision="bf16-mixed").peak
    # with shapes: during backward, the shard + three staged buckets (two in flight, one filling), each
    # 25 MiB or the largest parameter (the embedding here, a bucket of its own)
    shape = Shape(8, 1024, 16, 32000, 128)
    u = shape.units()
    lay = layout("zero2", 8)
    peak = step_peak(shape, lay, micro_batch_size=1, precision="32-true", optimizer="adamw", checkpointing=False)
    assert zero2_staged(lay, 4, u["total"], u["embed_table"]) == min(4 * u["total"], 3 * 4 * u["embed_table"])
    assert peak.peak < step_peak(shape, layout("zero1", 8), micro_batch_size=1, precision="32-true",
                                 optimizer="adamw", checkpointing=False).peak


def test_fsdp_gathered_units_and_prefetch() -> None:
    shape = Shape(8, 512, 8, 4096, 256)  # a quarter of the head is smaller than a block
    u = shape.units()
    base = estimate(shape, devices=8, strategy="fsdp", precision="32-true", checkpointing=True, prefetch=0)
    more = estimate(shape, devices=8, strategy="fsdp", precision="32-true", checkpointing=True, prefetch=2)
    assert more.peak - base.peak == 2 * 4 * u["block"]  # two more blocks gathered at full size
    tiled = estimate(shape, devices=8, strategy="fsdp", precision="32-true", checkpointing=True, prefetch=0,
                     tiling={"net.head.lm_head": 4})
    assert base.peak - tiled.peak == 4 * u["lm_head"]  # the head left the root unit: gathered a tile at a time


def test_byte_layouts_and_8bit_state() -> None:
    assert bytes_per_param("bf16-mixed", "adamw") == (4, 4, 8) == bytes_per_param("16-mixed", "adam")
    assert bytes_per_param("32-true", "sgd") == (4, 4, 4)
    assert bytes_per_param("bf16-true", "adamw") == (2, 2, 4)
    assert bytes_per_param("paper-mixed", "sgd") == (2, 2, 8)
    # torchao AdamW8bit: quantised tensors 2 x (1 + 4/256) + a 1 KiB map per state; small ones fp32 m and v
    assert optimizer_state_bytes(0, "adamw8bit", "32-true", tensor_numels=[8192, 100]) == \
        2 * (8192 + 4 * 32 + 1024) + 2 * 100 * 4
    with pytest.raises(ValueError, match="unknown precision"):
        estimate(1000, devices=2, strategy="ddp", precision="fp8")
    with pytest.raises(ValueError, match="unknown strategy 'zero4'"):
        estimate(1000, devices=2, strategy="zero4")


def test_pipeline_in_flight_and_tp_sharding() -> None:
    assert in_flight_micro_batches("gpipe", 4, 16) == 16 and in_flight_micro_batches("1f1b", 4, 16) == 4
    assert in_flight_micro_batches("interleaved_1f1b", 4, 16, 2) == pytest.approx(4 * (1 + 3 / 8))
    shape = Shape(8, 512, 8, 32000, 256)
    kw = dict(devices=8, precision="bf16-mixed", micro_batch_size=16)
    gpipe = estimate(shape, strategy="pipeline", schedule="gpipe", n_microbatches=16, **kw)
    ofob = estimate(shape, strategy="pipeline", schedule="1f1b", n_microbatches=16, **kw)
    assert gpipe.activations > 1.8 * ofob.activations  # 16 micro-batches in flight on stage 0, against 8
    kw["micro_batch_size"] = 8
    tp2 = estimate(shape, strategy="tensor_parallel", tp=2, **kw)
    tp8 = estimate(shape, strategy="tensor_parallel", **kw)
    assert tp8.mesh == {"tp": 8} and tp8.activations < tp2.activations and tp8.params < tp2.params


def test_shape_comes_from_the_module() -> None:
    n, shape = model_shape("gpt2")
    from lightning_par.models.module import GPTModule

    module = GPTModule(preset="gpt2")
    with torch.device("meta"):
        module.configure_model()
    assert n == sum(p.numel() for p in module.parameters()) == GPTConfig(**{**module.config.__dict__}).n_params
    assert (shape.n_layer, shape.n_embd, shape.seq_len) == (12, 768, 1024)


def test_table_marks_fit() -> None:
    table = estimate_table(7.5e9, devices=64, precision="paper-mixed", device_memory=32, unit="GB")
    lines = {line.split()[0]: line for line in table.splitlines()[3:]}
    assert list(lines) == list(STRATEGIES)
    assert lines["ddp"].endswith("NO") and lines["zero1"].endswith("yes") and lines["zero3"].endswith("yes")


def test_mode_estimate_writes_the_table_as_json(tmp_path) -> None:
    """3d with its own tp/pp, trainer.devices=auto (1 on CPU) x num_nodes, figures = the printed ones."""
    cmd = [sys.executable, "run.py", "mode=estimate", "model=gpt_tiny", "strategy=3d", "trainer.devices=auto",
           "trainer.num_nodes=8", "strategy.tp=2", "strategy.pp=2", "data.global_batch_size=8",
           f"paths.output_dir={tmp_path}", "+estimate.unit=GB", "+estimate.device=cpu"]
    done = launch.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "estimate.json").read_text())
    assert record["world_size"] == 8 and record["mesh"] == {"pp": 2, "dp_shard": 2, "tp": 2}
    assert record["micro_batch_size"] == 4  # 8 sequences over dp = 2
    rows = {r["strategy"]: r for r in record["strategies"]}
    assert set(rows) == set(STRATEGIES) | {"3d"}
    printed = {ln.split()[0]: ln.split() for ln in done.stdout.splitlines() if ln.split()[:1] and ln.split()[0] in rows}
    for name, row in rows.items():
        assert float(printed[name][-2]) == pytest.approx(row["peak"] / 1e9, abs=1e-3)
        assert row["total"] == row["peak"] and row["peak"] >= row["states"]


def test_cli(capsys) -> None:
    main(["--model", "gpt2_xl", "--devices", "64", "--precision", "paper-mixed", "--device-memory", "80"])
    out = capsys.readouterr().out
    assert "N = 64" in out and "zero3_offload" in out and "fits 80 GiB" in out
    with pytest.raises(SystemExit):
        main(["--model", "no_such_model", "--devices", "2"])
    assert "choose one of gpt_tiny" in capsys.readouterr().err
    done = launch.run([sys.executable, "-m", "lightning_par.modes.estimate", "--params", "1e9", "--devices", "8"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "zero2" in done.stdout


def test_synthetic_tokens_hold_any_vocabulary() -> None:
    """Large-vocabulary shapes (the estimator's loss-buffer cases) train on synthetic tokens: ids above
    32767 must survive storage (int16 wrapped them negative before)."""
    from lightning_par.data.datamodules import SyntheticTokens, token_dtype

    assert token_dtype(256) == torch.int16 and token_dtype(32769) == torch.int32 and token_dtype(2**40) == torch.int64
    data = SyntheticTokens(n_samples=64, seq_len=16, vocab_size=50304)
    data.setup()
    x, y = data.train_set[0]
    assert x.dtype == torch.long and int(x.min()) >= 0 and int(torch.stack([data.train_set[i][0] for i in range(60)]).max()) > 32767


def test_selective_checkpointing_keeps_between_none_and_full() -> None:
    """Selective checkpointing (matmul and attention-core outputs kept) saves less than no checkpointing
    and more than full, on both attention paths; its peak against MemTracker is in test_activation_memory.py.
    Not priced for MoE layers or under tensor parallelism: a ValueError, one line."""
    kw = dict(devices=1, strategy="single", precision="32-true", micro_batch_size=2)
    for shape in (Shape(2, 32, 2, 256, 128, dropout=0.1), Shape(2, 32, 2, 256, 128)):  # math path, fused
        act = {c: estimate(shape, checkpointing=c, device="cpu", **kw).activations for c in (False, "selective", True)}
        assert act[True] < act["selective"] < act[False], act
    with pytest.raises(ValueError, match="selective checkpointing of MoE layers"):
        estimate(Shape(2, 32, 2, 256, 128, n_experts=4, top_k=2), checkpointing="selective", device="cpu", **kw)


def test_fsdp_without_gradient_sync_holds_full_gradients(tmp_path) -> None:
    """``strategy.grad_sync=last_micro_batch``: with accumulation the estimate holds every unsharded
    gradient (the model's fp32 gradients, not 1/8 of them); without accumulation nothing changes."""
    def fsdp_row(*extra: str) -> dict:
        out = tmp_path / "_".join(extra).replace("=", "-").replace(".", "-")
        cmd = [sys.executable, "run.py", "mode=estimate", "model=gpt2", "strategy=fsdp", "trainer.devices=8",
               "data.global_batch_size=32", f"paths.output_dir={out}", *extra]
        done = launch.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        record = json.loads((out / "estimate.json").read_text())
        return {r["strategy"]: r for r in record["strategies"]}["fsdp"]

    every = fsdp_row("trainer.accumulate_grad_batches=4")
    last = fsdp_row("trainer.accumulate_grad_batches=4", "strategy.grad_sync=last_micro_batch")
    once = fsdp_row("strategy.grad_sync=last_micro_batch")
    n_params = GPTConfig(**PRESETS["gpt2"]).n_params
    assert last["grads"] == pytest.approx(4 * n_params, rel=1e-3) and every["grads"] == pytest.approx(last["grads"] / 8, rel=1e-2)
    assert last["peak"] > every["peak"] + 0.8 * (last["grads"] - every["grads"])
    assert once["grads"] == fsdp_row()["grads"]


@pytest.mark.parametrize("name,total", [("hf_llama_1b", 1_235_814_400), ("hf_qwen2_0p5b", 494_032_768)])
def test_hf_preset_counts_are_the_transformers_models(name, total) -> None:
    """A Hugging Face preset's shape and ``units`` come from the model the app builds: the composed
    ``model=<name>`` config, ``HFCausalLM`` on the meta device. The tied head counts once in the total;
    the layer's, the embedding's and the head's counts and each linear's are the model's own; tensor
    parallelism splits every matrix (vocabulary rows of the shared table included), not the norms."""

    from lightning_par.costs.comm import CommShape
    from tests.helpers import composed

    n, shape = model_shape(name)
    module = instantiate_model(composed(f"model={name}", f"data.seq_len={shape.seq_len}").model)
    net = module.build_hf("meta")
    layer, cfg, u = net.model.layers[0], module.hf_config, shape.units()
    assert n == u["total"] == sum(p.numel() for p in net.parameters()) == total  # a shared parameter once
    assert u["block"] == sum(p.numel() for p in layer.parameters())
    assert {k: v for k, v in u.items() if k.startswith("block.")} == {
        f"block.{path}": m.weight.numel() for path, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    assert u["embed"] == u["embed_table"] == u["lm_head"] == u["tied"] == net.model.embed_tokens.weight.numel()
    assert net.lm_head.weight is net.model.embed_tokens.weight and u["head"] == u["lm_head"] + cfg.hidden_size
    sizes = (shape.n_layer, shape.n_embd, shape.n_head, shape.n_kv_heads, shape.inner, shape.vocab_size, shape.seq_len)
    assert sizes == (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                     cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings)
    assert shape.gated_mlp and shape.rms_norm and shape.tied and not shape.learned_positions
    assert layer.self_attn.k_proj.weight.shape[0] == shape.kv_width < shape.n_embd  # grouped-query attention
    norms = (2 * shape.n_layer + 1) * shape.n_embd
    cs = CommShape(shape=shape, micro_batch=1)
    assert cs.tp_params(2) == (total - norms) // 2 + norms and cs.root_params() == u["embed"] + cfg.hidden_size


def test_hf_preset_estimates() -> None:
    """The estimator's table for a Hugging Face preset; its sequence defaults to max_positions and can
    be shorter, never longer; an architecture the activation model does not describe is refused."""
    n, shape = model_shape("hf_llama_1b", 1024)
    assert shape.seq_len == 1024 and n == model_shape("hf_llama_1b")[0]
    one = estimate("hf_llama_1b", devices=1, strategy="single", precision="bf16-mixed")
    assert one.params == 4 * n and one.optimizer_state == 8 * n and one.activations > 0
    with pytest.raises(ValueError, match="exceeds max_positions"):
        model_shape("hf_llama_1b", 4096)
    from lightning_par.models.hf.causal_lm import hf_config

    with pytest.raises(ValueError, match="no op-by-op shape for a 'gemma2'"):
        Shape.of(hf_config("gemma2", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256,
                           max_positions=64, tie_word_embeddings=True, attn_implementation="eager"))
