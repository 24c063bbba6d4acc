"""Memory-centric tiling (lightning_par/parallel/memory/tiling.py).

- ``TiledLinear`` is the same function as the layer it replaces (fp32, atol 1e-6), gradients included.
- Loss parity: fsdp at 2 ranks with the LM head in 4 tiles vs the untiled single-device run, 12
  steps, rtol 1e-5 (the bound of the other fsdp parity tests: only the reduction order differs).
- Layout: each tile is its own FSDP unit of 1/4 of the head, and the most bytes of the head
  gathered at once during a forward (measured from the live parameters: FSDP2 swaps a unit's
  sharded DTensors for plain full tensors while it is gathered) falls from the head to one tile.
- A tied embedding and head (Hugging Face Llama, ``tie_word_embeddings=true``) are tiled together,
  whichever path is named: head tile i's weight is embedding tile i's Parameter, each pair one FSDP
  unit of 1/4 of the table, gathered one tile at a time in forward and in backward (the whole table
  untiled); the untiled tied single run's losses under fsdp, zero3 (resumed from fsdp's step-6
  checkpoint) and a 2-stage pipeline (rtol 1e-5), the tie holding in the step-12 checkpoint.

The parity runs share one process, one after another (``runs``, ``tests/serial.py``); the untiled GPT's
reference is the shared single-device sweep's run of the same config.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_par import ConfigError
from lightning_par.parallel.memory.tiling import TiledEmbedding, TiledLinear, apply_tiling, check_tiling
from tests.dist import run_distributed
from tests.helpers import QUICK, assert_losses_match


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

    from lightning_par.parallel.memory.tiling import TiledConv1D

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
    from lightning_par.run.tiling_option import set_tiling
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


def _tied(vocab: int = 24, dim: int = 8) -> nn.ModuleDict:
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(vocab, dim), "head": nn.Linear(dim, vocab, bias=False)})
    model["head"].weight = model["emb"].weight
    return model


@pytest.mark.parametrize("named", [{"head": 4}, {"emb": 4}, {"emb": 4, "head": 4}])
def test_tied_embedding_and_head_are_tiled_together(named):
    """Naming either tied layer (or both, with one count) tiles both in the same row blocks of the
    shared weight, kept tied (one Parameter per tile); the same function and the same gradient of the
    shared weight (the sum of both uses')."""
    from lightning_par.parallel.memory.tiling import TiedHead

    ref, model = _tied(), _tied()
    paths = apply_tiling(model, named)
    assert paths == [f"emb.tiles.{i}" for i in range(4)]  # one unit per pair, under its first path
    emb, head = model["emb"], model["head"]
    assert isinstance(emb, TiledEmbedding) and isinstance(head, TiedHead)
    assert all(head.tiles[i].weight is emb.tiles[i].weight for i in range(4))
    assert len(list(model.parameters())) == 4
    ids = torch.randint(0, 24, (3, 11))
    y_ref, y = ref["head"](ref["emb"](ids)), head(emb(ids))
    # a head tile is a matmul of its own: the CPU's BLAS may pick another kernel for the smaller shape and
    # round differently (bit-equal on an earlier machine; 1.9e-6 absolute, 4.6e-5 relative on this one)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-4)
    g = torch.randn_like(y)
    y_ref.backward(g)
    y.backward(g)
    # the head's part is a (vocab block x tokens) @ (tokens x dim) product: blocked differently, fp32 rounding
    torch.testing.assert_close(torch.cat([t.weight.grad for t in emb.tiles]), ref["emb"].weight.grad, atol=1e-5, rtol=0)


def test_ties_tiling_cannot_keep_are_one_line():
    with pytest.raises(ConfigError, match="emb and head share one weight.*same tile count, not 4 and 2") as e:
        apply_tiling(_tied(), {"emb": 4, "head": 2})
    assert "\n" not in str(e.value)
    from lightning_par.strategies import SingleDeviceStrategy
    from lightning_par.run.tiling_option import set_tiling

    with pytest.raises(ConfigError, match="same tile count, not 4 and 2"):  # the app's check, before processes start
        set_tiling(SingleDeviceStrategy(), {"emb": 4, "head": 2}, _tied())
    three = _tied()
    three["head2"] = nn.Linear(8, 24, bias=False)
    three["head2"].weight = three["emb"].weight
    with pytest.raises(ConfigError, match="also used by head.weight and head2.weight"):
        apply_tiling(three, {"emb": 2})
    two_tables = nn.ModuleDict({"a": nn.Embedding(24, 8), "b": nn.Embedding(24, 8)})
    two_tables["b"].weight = two_tables["a"].weight
    with pytest.raises(ConfigError, match="only an nn.Embedding tied to an nn.Linear output head"):
        apply_tiling(two_tables, {"a": 2})
    alias = nn.ModuleDict({"shared": nn.Embedding(24, 8)})
    alias["encoder"] = alias["shared"]
    with pytest.raises(ConfigError, match="also registered as encoder"):
        apply_tiling(alias, {"shared": 2})

    class Scaled(nn.Embedding):  # Gemma's scaled word embedding: a forward tiles would not compute
        def forward(self, ids):
            return super().forward(ids) * 2.0

    with pytest.raises(ConfigError, match="Scaled with its own forward"):
        apply_tiling(nn.ModuleDict({"tok": Scaled(24, 8)}), {"tok": 2})
    with pytest.raises(ConfigError, match="only nn.Linear, nn.Embedding and"):
        apply_tiling(nn.ModuleDict({"norm": nn.LayerNorm(8)}), {"norm": 2})


def _tied_llama(vocab: int = 256):
    """A tiny Hugging Face Llama with tied input and output embeddings, built on the meta device."""
    from lightning_par.models.hf.causal_lm import HFCausalLM

    model = HFCausalLM(arch="llama", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=vocab,
                       max_positions=64, tie_word_embeddings=True)
    with torch.device("meta"):
        model.configure_model()
    return model


def test_tied_tiles_materialise_to_the_untiled_weights():
    """Deferred initialisation of the tied Llama with its embedding and head tiled gives exactly the
    untiled model's shared weight, row block by row block, and the tie survives ``to_empty``."""
    from lightning_par.parallel.discovery import init_fn_of, resolve_plan
    from lightning_par.parallel.parallelize import Techniques, parallelize

    def built(tiling: dict) -> nn.Module:
        model = _tied_llama()
        parallelize(model, Techniques(device=torch.device("cpu"), plan=resolve_plan(model), seed=3,
                                      init_fn=init_fn_of(model), tiling=tiling))
        return model.net

    ref, tiled = built({}), built({"net.model.embed_tokens": 4})
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    emb, head = tiled.model.embed_tokens, tiled.lm_head
    assert all(head.tiles[i].weight is emb.tiles[i].weight for i in range(4))
    torch.testing.assert_close(torch.cat([t.weight for t in emb.tiles]), ref.model.embed_tokens.weight, atol=0, rtol=0)
    others = {n: p for n, p in ref.named_parameters() if "embed_tokens" not in n}
    assert others and all(torch.equal(p, tiled.get_parameter(n)) for n, p in others.items())


GPT_TILING = "{net.head.lm_head:4,net.embed.tok:4,net.blocks.0.attn.wq:2,net.blocks.1.attn.wo:2,net.blocks.0.mlp.fc:4}"
HF = ["model=hf_causal_lm", "model.hidden=64", "model.intermediate=128"]
HF_TILING = "{net.model.embed_tokens:4,net.model.layers.0.self_attn.q_proj:2,net.model.layers.1.mlp.gate_proj:4}"
GPT2 = ["model=hf_causal_lm", "model.arch=gpt2", "model.kv_heads=null", "model.intermediate=128"]
GPT2_TILING = "{net.transformer.h.0.attn.c_attn:4,net.transformer.h.1.mlp.c_fc:2,net.transformer.h.1.attn.c_proj:2}"
TIED = ["model=hf_causal_lm", "model.hidden=64", "model.intermediate=128", "model.tie_word_embeddings=true"]
BOTH = "{net.model.embed_tokens:4,net.lm_head:4}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The runs of the parity tests below, one after another in one process (``tests/serial.py``: each as
    ``python run.py ...`` runs it, in a run directory of its own); zero3 resumes from the tied fsdp run's
    step-6 checkpoint, so it runs after it. (The untiled GPT reference is the shared single-device sweep's.)"""
    from tests import serial

    root = tmp_path_factory.mktemp("runs")
    fsdp = ["strategy=fsdp", "trainer.devices=2"]
    return serial.app_runs({
        "gpt-fsdp": [*QUICK, *fsdp, f"+strategy.tiling={GPT_TILING}"],
        "hf-single": [*QUICK, *HF],
        "hf-fsdp": [*QUICK, *HF, *fsdp, f"+strategy.tiling={HF_TILING}"],
        "gpt2-single": [*QUICK, *GPT2],
        "gpt2-fsdp": [*QUICK, *GPT2, *fsdp, f"+strategy.tiling={GPT2_TILING}"],
        "tied-single": [*QUICK, *TIED],
        "tied-fsdp": [*QUICK, *TIED, *fsdp, f"+strategy.tiling={BOTH}", "callbacks=checkpoint",
                      "callbacks.checkpoint.every_n_train_steps=3"],
        "tied-zero3": [*QUICK, *TIED, "strategy=zero3", "trainer.devices=2", "+strategy.tiling={net.model.embed_tokens:4}",
                       f"ckpt_path={root / 'tied-fsdp' / 'checkpoints' / 'step000006.ckpt'}"],
        "tied-pipeline": [*QUICK, *TIED, "strategy=pipeline", "trainer.devices=2",
                          "+strategy.tiling={net.model.embed_tokens:4}"],
    }, root)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first one runs them all (``runs``)
def test_tiled_fsdp_matches_untiled_single(runs):
    """Every kind of large layer tiled at once -- the vocabulary embedding (row tiles), attention
    projections, the MLP and the head -- under fsdp at 2 ranks: the untiled single run's losses (the shared
    single-device sweep's run of the same config, ``sweeps.single_refs``)."""
    from tests.sweeps import single_refs

    assert_losses_match(runs["gpt-fsdp"].summary(), single_refs()[0], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first one runs them all (``runs``)
def test_tiled_hugging_face_model_matches_untiled_single(runs):
    """A Hugging Face Llama (built from a config) with its token embedding, a query projection and an
    MLP projection tiled, under fsdp at 2 ranks: the untiled single run's losses (rtol 1e-5)."""
    assert_losses_match(runs["hf-fsdp"].summary(), runs["hf-single"].summary(), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first one runs them all (``runs``)
def test_tiled_gpt2_conv1d_matches_untiled_single(runs):
    """A Hugging Face GPT-2 (built from a config) with its fused c_attn, an MLP c_fc and
    an attention c_proj tiled (transformers' Conv1D, column tiles), under fsdp at 2 ranks: the untiled
    single run's losses (rtol 1e-5)."""
    assert_losses_match(runs["gpt2-fsdp"].summary(), runs["gpt2-single"].summary(), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first one runs them all (``runs``)
def test_tied_llama_tiled_matches_untiled_single(runs):
    """A Hugging Face Llama with tied embeddings, its embedding and head tiled together (both paths
    named under fsdp; only the embedding's under zero3 and the pipeline): the untiled tied single run's
    losses at rtol 1e-5 -- an untied head would train differently. zero3 resumes from fsdp's step-6
    checkpoint (DCP) and continues them; fsdp's step-12 checkpoint still holds one value per tile
    under both names."""
    import numpy as np
    import torch.distributed.checkpoint as dcp

    ref = runs["tied-single"].summary()
    fsdp = runs["tied-fsdp"].summary()
    assert_losses_match(fsdp, ref, rtol=1e-5)
    checkpoints = runs["tied-fsdp"].dir / "checkpoints"
    assert f"ckpt_path={checkpoints / 'step000006.ckpt'}" in runs["tied-zero3"].job.args
    resumed = runs["tied-zero3"].summary()
    np.testing.assert_allclose(resumed["losses"][-6:], ref["losses"][6:], rtol=1e-5, atol=1e-6)
    pipeline = runs["tied-pipeline"].summary()
    assert_losses_match(pipeline, ref, rtol=1e-5)
    names = [f"net.{layer}.tiles.{i}.weight" for i in range(4) for layer in ("model.embed_tokens", "lm_head")]
    state = {n: torch.empty(64, 64) for n in names}
    dcp.load({"model": state}, checkpoint_id=checkpoints / "step000012.ckpt", no_dist=True)
    for i in range(4):
        assert torch.equal(state[f"net.model.embed_tokens.tiles.{i}.weight"], state[f"net.lm_head.tiles.{i}.weight"])


def _gathered(rank: int, world: int, tiles: int) -> dict:
    """Per-unit bytes, and the most bytes of the LM head's parameters gathered at once in a forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_par.models.gpt import GPT, GPTConfig
    from lightning_par.parallel.discovery import init_fn_of, resolve_plan
    from lightning_par.parallel.parallelize import FullyShard, Techniques, parallelize
    from lightning_par.parallel.memory.tiling import largest_units

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
    return {"units": largest_units(model), "peak": peak[0], "tied": _tied_gathered(mesh, tiles)}


def _tied_gathered(mesh, tiles: int) -> dict:
    """The tied Llama's units, and the most bytes of its shared table held at full size at once, at
    every leaf module's forward -- in backward too: the tiles' checkpointed forwards run again there
    (prefetch 1: the tied tiles run twice per forward, ``fsdp.set_prefetch``)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from lightning_par.parallel.discovery import init_fn_of, resolve_plan
    from lightning_par.parallel.parallelize import FullyShard, Techniques, parallelize
    from lightning_par.parallel.memory.tiling import largest_units

    model = _tied_llama(vocab=4096)  # a table 8x a block
    spec = Techniques(device=torch.device("cpu"), plan=resolve_plan(model), seed=0, init_fn=init_fn_of(model),
                      fully_shard=FullyShard(mesh, prefetch=1), tiling={"net.lm_head": tiles} if tiles else {})
    parallelize(model, spec)
    emb, head = model.net.model.embed_tokens, model.net.lm_head
    peak = {"forward": 0, "backward": 0}
    phase = ["forward"]

    def record(module, args):
        full = sum(p.numel() * p.element_size() for p in emb.parameters() if not isinstance(p, DTensor))
        peak[phase[0]] = max(peak[phase[0]], full)

    for m in model.modules():
        if not list(m.children()):
            m.register_forward_pre_hook(record)
    ids = torch.randint(0, 4096, (2, 33))
    loss = model.loss_fn(model(ids[:, :-1]), ids[:, 1:])
    phase[0] = "backward"
    loss.backward()
    pairs = [(emb.tiles[i], head.tiles[i]) for i in range(tiles)]
    return {"units": largest_units(model), "peak": peak,
            "one_unit": all(e is h and isinstance(e, FSDPModule) for e, h in pairs),
            "tied": all(e.weight is h.weight for e, h in pairs) if tiles else head.weight is emb.weight}


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
    # the tied Llama: each pair of tiles is one module and one unit, of 1/4 of the shared table, which
    # left the root; one tile of it is gathered at a time in forward, and in backward too (``_Lookup``)
    table = 4096 * 64 * 4
    untiled, tiled = untiled["tied"], tiled["tied"]
    assert untiled["tied"] and tiled["tied"] and tiled["one_unit"]
    tile_units = {k: v for k, v in tiled["units"].items() if ".tiles." in k}
    assert tile_units == {f"net.model.embed_tokens.tiles.{i}": table // 4 for i in range(4)}, tile_units
    assert untiled["units"][""] - tiled["units"][""] == table
    assert untiled["peak"]["forward"] == table
    assert tiled["peak"] == {"forward": table // 4, "backward": table // 4}
