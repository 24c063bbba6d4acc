"""Memory-centric tiling (lightning_par/parallel/tiling.py).

- ``TiledLinear`` is the same function as the layer it replaces (fp32, atol 1e-6), gradients included.
- Loss parity: fsdp at 2 ranks with the LM head in 4 tiles vs the untiled single-device run, 12
  steps, rtol 1e-5 (the bound of the other fsdp parity tests: only the reduction order differs).
- Layout: each tile is its own FSDP unit of 1/4 of the head, and the most bytes of the head
  gathered at once during a forward (measured from the live parameters: FSDP2 swaps a unit's
  sharded DTensors for plain full tensors while it is gathered) falls from the head to one tile.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_par import ConfigError
from lightning_par.parallel.tiling import TiledEmbedding, TiledLinear, apply_tiling, check_tiling
from tests.dist import run_distributed
from tests.helpers import QUICK, assert_losses_match, train_summary


def test_tiled_linear_is_the_same_function():
    torch.manual_seed(0)
    layer = nn.Linear(16, 12)
    tiled = TiledLinear(layer, 3)
    x = torch.randn(5, 7, 16, requires_grad=True)
    y_ref, y = layer(x), tiled(x)
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=0)
    g = torch.randn_like(y)
    (gx_ref,) = torch.autograd.grad(y_ref, x, g)
    (gx,) = torch.autograd.grad(y, x, g)
    torch.testing.assert_close(gx, gx_ref, atol=1e-6, rtol=0)


def test_tiled_conv1d_is_the_same_function():
    """GPT-2's fused c_attn (transformers' Conv1D: a transposed linear) in column tiles: the same output
    and input gradient, and the tiles' weights are the untiled weight's column blocks."""
    from transformers.pytorch_utils import Conv1D

    from lightning_par.parallel.tiling import TiledConv1D

    torch.manual_seed(0)
    conv = Conv1D(3 * 16, 16)
    torch.nn.init.normal_(conv.bias)
    model = nn.ModuleDict({"c_attn": conv})
    apply_tiling(model, {"c_attn": 4})
    tiled = model["c_attn"]
    assert isinstance(tiled, TiledConv1D)
    torch.testing.assert_close(torch.cat([t.weight for t in tiled.tiles], dim=1), conv.weight, atol=0, rtol=0)
    x = torch.randn(2, 5, 16, requires_grad=True)
    y_ref, y = conv(x), tiled(x)
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=0)
    g = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(y_ref, x, g)[0], atol=1e-6, rtol=0)
    with pytest.raises(ConfigError, match="divide nf=48"):
        apply_tiling(nn.ModuleDict({"c": Conv1D(48, 16)}), {"c": 5})


def test_bad_tiling_is_one_line():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU())
    with pytest.raises(ConfigError, match="must be >= 2 and divide out_features=6"):
        apply_tiling(model, {"0": 4})
    with pytest.raises(ConfigError, match="only nn.Linear, nn.Embedding and transformers' Conv1D"):
        apply_tiling(model, {"1": 2})
    with pytest.raises(ConfigError, match="has no module 'head'"):
        apply_tiling(model, {"head": 2})
    from lightning_par.tiling_option import set_tiling
    from lightning_par.strategies import SingleDeviceStrategy

    with pytest.raises(ConfigError, match="4 tiles must be >= 2 and divide out_features=6"):
        set_tiling(SingleDeviceStrategy(), {"0": 4}, model)  # the app's check, before processes start
    with pytest.raises(ConfigError, match="also split by tensor parallelism"):
        check_tiling({"net.head.lm_head": 2}, {"head.lm_head": "output"})


def test_tiled_embedding_is_the_same_function():
    """Row tiles of the vocabulary: the same lookups, the same gradient rows, padding_idx kept."""
    torch.manual_seed(0)
    emb = nn.Embedding(24, 8, padding_idx=13)
    tiled = TiledEmbedding(emb, 4)
    assert tiled.tiles[2].padding_idx == 1 and tiled.tiles[0].padding_idx is None
    ids = torch.randint(0, 24, (3, 11))
    y_ref, y = emb(ids), tiled(ids)
    torch.testing.assert_close(y, y_ref, atol=0, rtol=0)
    g = torch.randn_like(y)
    y_ref.backward(g)
    y.backward(g)
    torch.testing.assert_close(torch.cat([t.weight.grad for t in tiled.tiles]), emb.weight.grad, atol=1e-6, rtol=0)


def test_tied_weights_are_not_tiled():
    head = nn.Linear(8, 24, bias=False)
    model = nn.ModuleDict({"emb": nn.Embedding(24, 8), "head": head})
    model["emb"].weight = head.weight
    with pytest.raises(ConfigError, match="tied to"):
        apply_tiling(model, {"head": 2})
    with pytest.raises(ConfigError, match="only nn.Linear, nn.Embedding and"):
        apply_tiling(nn.ModuleDict({"norm": nn.LayerNorm(8)}), {"norm": 2})


@pytest.mark.slow
def test_tiled_fsdp_matches_untiled_single(tmp_path):
    """Every kind of large layer tiled at once -- the vocabulary embedding (row tiles), attention
    projections, the MLP and the head -- under fsdp at 2 ranks: the untiled single run's losses."""
    ref = train_summary(QUICK, tmp_path / "single")
    tiling = ("{net.head.lm_head:4,net.embed.tok:4,net.blocks.0.attn.wq:2,net.blocks.1.attn.wo:2,"
              "net.blocks.0.mlp.fc:4}")
    got = train_summary([*QUICK, "strategy=fsdp", "trainer.devices=2", f"+strategy.tiling={tiling}"],
                        tmp_path / "fsdp_tiled")
    assert_losses_match(got, ref, rtol=1e-5)


@pytest.mark.slow
def test_tiled_hugging_face_model_matches_untiled_single(tmp_path):
    """A Hugging Face Llama (built from a config) with its token embedding, a query projection and an
    MLP projection tiled, under fsdp at 2 ranks: the untiled single run's losses (rtol 1e-5)."""
    hf = ["model=hf_causal_lm", "model.hidden=64", "model.intermediate=128"]
    ref = train_summary([*QUICK, *hf], tmp_path / "single")
    tiling = "{net.model.embed_tokens:4,net.model.layers.0.self_attn.q_proj:2,net.model.layers.1.mlp.gate_proj:4}"
    got = train_summary([*QUICK, *hf, "strategy=fsdp", "trainer.devices=2", f"+strategy.tiling={tiling}"],
                        tmp_path / "fsdp_tiled")
    assert_losses_match(got, ref, rtol=1e-5)


@pytest.mark.slow
def test_tiled_gpt2_conv1d_matches_untiled_single(tmp_path):
    """A Hugging Face GPT-2 (built from a config) with its fused c_attn, an MLP c_fc and
    an attention c_proj tiled (transformers' Conv1D, column tiles), under fsdp at 2 ranks: the untiled
    single run's losses (rtol 1e-5)."""
    hf = ["model=hf_causal_lm", "model.arch=gpt2", "model.kv_heads=null", "model.intermediate=128"]
    ref = train_summary([*QUICK, *hf], tmp_path / "single")
    tiling = "{net.transformer.h.0.attn.c_attn:4,net.transformer.h.1.mlp.c_fc:2,net.transformer.h.1.attn.c_proj:2}"
    got = train_summary([*QUICK, *hf, "strategy=fsdp", "trainer.devices=2", f"+strategy.tiling={tiling}"],
                        tmp_path / "fsdp_tiled")
    assert_losses_match(got, ref, rtol=1e-5)


def _gathered(rank: int, world: int, tiles: int) -> dict:
    """Per-unit bytes, and the most bytes of the LM head's parameters gathered at once in a forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_par.models.gpt import GPT, GPTConfig
    from lightning_par.parallel.discovery import init_fn_of, resolve_plan
    from lightning_par.parallel.parallelize import FullyShard, Techniques, parallelize
    from lightning_par.parallel.tiling import largest_units

    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=4096)  # a head larger than a block
    with torch.device("meta"):
        model = GPT(cfg)
    mesh = init_device_mesh("cpu", (world,))
    spec = Techniques(device=torch.device("cpu"), plan=resolve_plan(model), seed=0, init_fn=init_fn_of(model),
                      fully_shard=FullyShard(mesh, prefetch=0), tiling={"head.lm_head": tiles} if tiles else {})
    parallelize(model, spec)
    peak = [0]
    def record(module, args):  # the head's parameter bytes held at full size right now (live lookup)
        full = sum(p.numel() * p.element_size() for p in model.head.lm_head.parameters() if not isinstance(p, DTensor))
        peak[0] = max(peak[0], full)

    for m in model.modules():
        if not list(m.children()):
            m.register_forward_pre_hook(record)
    model(torch.randint(0, cfg.vocab_size, (2, 32)))
    return {"units": largest_units(model), "peak": peak[0]}


@pytest.mark.slow
def test_each_tile_is_a_unit_and_the_gathered_peak_shrinks():
    head = 4096 * 64 * 4  # bytes of the untiled LM head
    untiled = run_distributed(_gathered, 2, 0, timeout=120)[0]
    tiled = run_distributed(_gathered, 2, 4, timeout=120)[0]
    tile_units = {k: v for k, v in tiled["units"].items() if ".tiles." in k}
    assert sorted(tile_units) == [f"head.lm_head.tiles.{i}" for i in range(4)]
    assert all(v == head // 4 for v in tile_units.values()), tile_units
    assert untiled["units"][""] - tiled["units"][""] == head  # the head left the root unit
    # gathered at once during the forward: the whole head before, one tile of it after (prefetch 0)
    assert (untiled["peak"], tiled["peak"]) == (head, head // 4)
