"""Pretrained weights in, shard by shard (issue 20, part 1).

Four local checkpoints written here with ``save_pretrained`` (a Llama with grouped-query attention,
a Qwen2, a GPT-2 with tied embeddings, a Mixtral MoE; never downloaded) are loaded by a LightningModule written in
this test through ``lightning_par.models.from_pretrained(DIR)`` in ``configure_model``, under every
strategy (2 ranks; 4 for hsdp and fsdp_tp; 8 for 3d; the Mixtral under expert_parallel, ddp and
fsdp). Step 0's loss must equal transformers' own
``AutoModelForCausalLM.from_pretrained(DIR)`` forward on the same batch (fp32, rtol 1e-5), and
step 1 (after one AdamW step from the loaded weights) must equal lp_single's. transformers' own
``AutoModelForCausalLM.from_pretrained(DIR)`` in ``configure_model`` gives the same. One script run
holds every cell of a world size in the same processes.

Trained weights out (issue 20, part 2), from the same runs: each cell saves its checkpoint after the
two steps (``trainer.save_checkpoint``), and every one -- every strategy at its world size, 3d's
8-rank checkpoint included -- is exported (``lightning_par.strategies.checkpoint.export``) and opened with transformers'
``from_pretrained``: its logits equal the checkpoint's own tensors read back with
torch.distributed.checkpoint into the architecture (rtol 1e-5), and lp_single's exported model's
to within 1e-4 of how far training moved them, and differ from the untrained model's. (Two AdamW steps
under another reduction order: Adam scales a gradient that is only rounding noise -- GPT-2's key
bias gets none, as softmax ignores a shift of all of a query's scores -- to a step of up to ~lr/10,
so such parameters differ by ~1e-4 and GPT-2's logits under tensor parallelism by 2.2e-5, against
1.65 moved by training; a wrong layout moves them by as much as training does.)
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests import launch

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "qwen2", "gpt2", "mixtral")
BY_WORLD = {
    1: ["lp_single"],
    2: ["lp_ddp", "lp_zero1", "lp_zero2", "lp_zero3", "lp_zero3_offload", "lp_fsdp", "lp_tensor_parallel",
        "lp_pipeline", "lp_expert_parallel"],
    4: ["lp_hsdp", "lp_fsdp_tp"],
    8: ["lp_3d"],
}
# the MoE (a Mixtral: 4 experts, top 2) under expert parallelism and the data-parallel strategies beside
# it; expert parallelism is for MoE models only
MOE_CELLS = ("lp_single", "lp_ddp", "lp_fsdp", "lp_expert_parallel")


def runs(fam: str, strategy: str) -> bool:
    return strategy in MOE_CELLS if fam == "mixtral" else strategy != "lp_expert_parallel"

VOCAB, SEQ, BATCH = 300, 16, 8
# transformers declares neither plan for GPT-2: both are derived (parallel/hf/tp_derive.py: packed c_attn;
# parallel/hf/pp_derive.py: read off its forward), so it runs under every strategy
REFUSED: set[tuple[str, str]] = set()

MAKE = textwrap.dedent('''
    import sys, torch
    from transformers import AutoConfig, AutoModelForCausalLM
    out = sys.argv[1]
    SMALL = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, vocab_size=300,
                 max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    EXTRA = {"llama": dict(num_key_value_heads=2, head_dim=16), "qwen2": dict(num_key_value_heads=2),
             "gpt2": dict(n_embd=64, n_layer=4, n_head=4, n_positions=64, tie_word_embeddings=True,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
             "mixtral": dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                             router_aux_loss_coef=0.0)}
    for i, fam in enumerate(EXTRA):
        torch.manual_seed(i)
        cfg = AutoConfig.for_model(fam, **SMALL, **EXTRA[fam])
        net = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # not an init any strategy could reproduce by itself
            for p in net.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        net.save_pretrained(f"{out}/{fam}", max_shard_size="100KB" if fam == "llama" else "5GB")  # llama: sharded
''')

SCRIPT = textwrap.dedent('''
    import json, os, sys, warnings, logging
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    import torch.nn.functional as F
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    import lightning_par.models
    import lightning_par.strategies  # registers lp_single, lp_zero3, ...

    class FineTune(L.LightningModule):  # a user's own module, as README case 1 writes it
        def __init__(self, directory):
            super().__init__()
            self.directory, self.net = directory, None

        def configure_model(self):
            if self.net is None and self.directory.endswith("+transformers"):  # transformers' own call
                from transformers import AutoModelForCausalLM
                self.net = AutoModelForCausalLM.from_pretrained(self.directory.removesuffix("+transformers"))
            elif self.net is None:
                self.net = lightning_par.models.from_pretrained(self.directory)

        def loss_fn(self, logits, target):  # a pipeline's last stage calls it
            return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.loss_fn(self.net(input_ids=x).logits, y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Losses(L.Callback):
        def __init__(self):
            self.values = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.values.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    def run(strategy, devices, directory, ids):
        L.seed_everything(0, verbose=False)
        losses = Losses()
        trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=2, callbacks=[losses],
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        dp = {"lp_single": 1, "lp_tensor_parallel": 1, "lp_pipeline": 1, "lp_fsdp_tp": 2, "lp_3d": 2}.get(strategy, devices)
        data = TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
        try:
            trainer.fit(FineTune(directory), DataLoader(data, batch_size=BATCH // dp, shuffle=False))
        except ValueError as e:  # a refusal: one line before the first step, on every rank alike
            return {"error": str(e).strip(), "losses": losses.values}
        if not directory.endswith("+transformers"):  # the trained weights, for the export test
            name = os.path.basename(directory)
            trainer.save_checkpoint(f"{root}/trained/{name}-{strategy}.ckpt")
        return losses.values

    out, devices, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    cells, BATCH = json.loads(sys.argv[4]), int(sys.argv[5])
    ids = torch.load(f"{root}/ids.pt")
    result = {f"{fam}/{s}": run(s, devices, f"{root}/{fam}", ids) for fam, s in cells}
    if devices == 2:  # transformers' own AutoModelForCausalLM.from_pretrained(DIR) in configure_model
        result.update({f"{fam}+transformers/{s}": run(s, devices, f"{root}/{fam}+transformers", ids)
                       for fam, s in (("llama", "lp_fsdp"), ("qwen2", "lp_pipeline"), ("gpt2", "lp_zero3"))})
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(result, f)
''')


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _run(script: str, *args: str, cwd: Path, timeout: int = 400) -> None:
    path = cwd / "script.py"
    path.write_text(script)
    proc = launch.run([sys.executable, str(path), *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pretrained")
    _run(MAKE, str(root), cwd=root)
    import torch

    g = torch.Generator().manual_seed(3)
    torch.save(torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g), root / "ids.pt")
    return root


def transformers_loss(directory: Path, ids) -> float:
    """Step 0 as transformers itself computes it: ``from_pretrained`` and one forward."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        logits = net(input_ids=ids[:, :-1]).logits
    return float(F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()))


@pytest.fixture(scope="module")
def trained(checkpoints: Path) -> dict:
    """Every cell's losses, each world size in one script run; the checkpoints land in ``trained/``."""
    got: dict[str, list[float]] = {}
    for world, strategies in BY_WORLD.items():
        out = checkpoints / f"losses_{world}.json"
        cells = [(fam, s) for fam in FAMILIES for s in strategies if runs(fam, s)]
        _run(SCRIPT, str(out), str(world), str(checkpoints), json.dumps(cells), str(BATCH), cwd=checkpoints,
             timeout=900)
        got.update(json.loads(out.read_text()))
    return got


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_strategy_starts_from_the_checkpoint_transformers_loads(checkpoints: Path, trained: dict) -> None:
    import torch

    assert len(list((checkpoints / "llama").glob("model-*.safetensors"))) > 1  # the sharded layout is read too
    ids = torch.load(checkpoints / "ids.pt")
    want = {fam: transformers_loss(checkpoints / fam, ids) for fam in FAMILIES}
    got = trained
    for fam, s in (("llama", "lp_fsdp"), ("qwen2", "lp_pipeline"), ("gpt2", "lp_zero3")):
        own = got[f"{fam}+transformers/{s}"]
        assert isinstance(own, list), own  # transformers' own call in configure_model, filled shard by shard
        np.testing.assert_allclose(own, got[f"{fam}/{s}"], rtol=1e-6, err_msg=f"{fam} {s} via transformers")
    for fam in FAMILIES:
        single = got[f"{fam}/lp_single"]
        assert abs(single[1] - single[0]) > 1e-3, (fam, single)  # the step changed the weights
        for s in (s for s in sum(BY_WORLD.values(), []) if runs(fam, s)):
            losses = got[f"{fam}/{s}"]
            if (fam, s) in REFUSED:
                assert isinstance(losses, dict) and not losses["losses"], (fam, s, losses)
                assert len(losses["error"].splitlines()) == 1 and "plan" in losses["error"], losses["error"]
                continue
            print(f"  {fam:6s} {s:20s} step0 {losses[0]:.6f} (transformers {want[fam]:.6f})  step1 {losses[1]:.6f}")
            np.testing.assert_allclose(losses[0], want[fam], rtol=1e-5, err_msg=f"{fam} {s} step 0")
            np.testing.assert_allclose(losses[1], single[1], rtol=1e-5, err_msg=f"{fam} {s} step 1")


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the runs (the module's ``trained``) count when this test is the first to need them
def test_every_strategys_checkpoint_exports_to_the_trained_model(checkpoints: Path, trained: dict,
                                                                 tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_par.strategies.checkpoint.export import export
    from tests.test_export import _checkpoint_model, _logits

    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))
    done = []
    for fam in FAMILIES:
        untrained = _logits(AutoModelForCausalLM.from_pretrained(checkpoints / fam, dtype=torch.float32), ids)
        single = None
        for s in ["lp_single", *(s for s in sum(BY_WORLD.values(), []) if runs(fam, s) and s != "lp_single")]:
            if (fam, s) in REFUSED:
                continue
            checkpoint = checkpoints / "trained" / f"{fam}-{s}.ckpt"
            line = export(checkpoint, tmp_path / f"{fam}-{s}", max_shard_bytes=200_000)
            assert ": transformers" in line, line
            got = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / f"{fam}-{s}", dtype=torch.float32), ids)
            torch.testing.assert_close(got, _logits(_checkpoint_model(checkpoints / fam, checkpoint), ids),
                                       rtol=1e-5, atol=1e-6, msg=f"{fam} {s}: export vs its checkpoint")
            single = got if s == "lp_single" else single
            moved = float((single - untrained).abs().max())
            assert moved > 1e-2, f"{fam}: training changed nothing"
            assert float((got - single).abs().max()) <= 1e-4 * moved, (fam, s, float((got - single).abs().max()), moved)
            done.append(f"{fam}/{s}")
    print(f"  exported and matched: {len(done)} checkpoints: {', '.join(done)}")
    assert {"llama/lp_hsdp", "llama/lp_fsdp_tp", "llama/lp_3d", "gpt2/lp_3d", "mixtral/lp_expert_parallel",
            "qwen2/lp_zero3_offload"} <= set(done)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoints_get_one_line_naming_the_path(checkpoints: Path, tmp_path: Path) -> None:
    """Every bad input of issue 20 part 6 for the weights: one ``ConfigError`` line naming the path,
    raised while the model is built on the meta device (in the app: before any process starts)."""
    import torch

    import lightning_par.models
    from lightning_par import ConfigError

    def error(directory: Path) -> str:
        with torch.device("meta"), pytest.raises(ConfigError) as info:
            lightning_par.models.from_pretrained(directory)
        message = str(info.value)
        assert len(message.splitlines()) == 1, message
        return message

    assert "is not a directory" in error(tmp_path / "missing")
    assert "has no config.json" in error(tmp_path)
    mismatch = _copy(checkpoints / "qwen2", tmp_path / "mismatch")  # a Qwen2's tensors under GPT-2's config
    (mismatch / "config.json").write_text((checkpoints / "gpt2" / "config.json").read_text())
    assert "has no tensor transformer." in error(mismatch)
    wrong = _copy(checkpoints / "qwen2", tmp_path / "shapes")  # config says another MLP size
    cfg = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    message = error(wrong)
    assert "mlp" in message and "(128, 64)" in message and "(96, 64)" in message, message
    extra = _copy(checkpoints / "qwen2", tmp_path / "extra")  # config says fewer layers than the file holds
    (extra / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    assert "config.json cannot be read" in error(extra) and "layer_types" in error(extra)  # transformers' own check
    (extra / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2, "layer_types": cfg["layer_types"][:2]}))
    assert "model.layers.2." in error(extra) and "does not have" in error(extra)
    shard = _copy(checkpoints / "llama", tmp_path / "shard")  # a sharded checkpoint missing one shard file
    sorted(shard.glob("model-*.safetensors"))[-1].unlink()
    assert "shard file" in error(shard) and "is missing" in error(shard)
    damaged = _copy(checkpoints / "gpt2", tmp_path / "damaged")
    raw = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(raw[:8] + b"{not json" + raw[17:])
    assert "is not a readable safetensors file" in error(damaged)
    bare = _copy(checkpoints / "gpt2", tmp_path / "bare")
    (bare / "model.safetensors").rename(bare / "pytorch_model.bin")
    assert "save_pretrained(safe_serialization=True)" in error(bare)
    seq2seq = tmp_path / "t5"
    seq2seq.mkdir()
    (seq2seq / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 64}))
    assert "not know as a causal language model" in error(seq2seq)


def test_the_run_dtype_wins_and_meta_outside_a_strategy_is_refused(checkpoints: Path, tmp_path: Path) -> None:
    """A checkpoint saved in bf16 is built in the run's dtype (fp32 here), not config.json's; on the meta
    device outside a lightning_par strategy nothing would read the weights: one line."""
    import torch
    from transformers import AutoModelForCausalLM

    import lightning_par.models
    from lightning_par import ConfigError
    from lightning_par.models.hf.pretrained import build_pretrained, pretrained_config

    AutoModelForCausalLM.from_pretrained(checkpoints / "qwen2").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    cfg = pretrained_config(tmp_path / "bf16")
    assert str(cfg.dtype).endswith("bfloat16")
    net = build_pretrained(cfg, tmp_path / "bf16", "meta")
    assert {p.dtype for p in net.parameters()} == {torch.float32}
    with torch.device("meta"), pytest.raises(ConfigError, match="outside a lightning_par strategy"):
        lightning_par.models.from_pretrained(tmp_path / "bf16")


def test_outside_a_strategy_from_pretrained_is_transformers_loading(checkpoints: Path) -> None:
    """On a real device (a plain Trainer, a notebook) the call loads the weights itself."""
    import torch

    import lightning_par.models
    from transformers import AutoModelForCausalLM

    ours = lightning_par.models.from_pretrained(checkpoints / "llama")
    theirs = AutoModelForCausalLM.from_pretrained(checkpoints / "llama", dtype=torch.float32)
    assert not any(p.is_meta for p in ours.parameters())
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    # a call that does not ask for the key/value cache gets none (training keeps no cache); the config keeps
    # the checkpoint's use_cache, which generation reads, and a call may still ask for it
    ids = torch.randint(0, VOCAB, (1, 8))
    assert ours.config.use_cache is theirs.config.use_cache is True
    assert ours(input_ids=ids).past_key_values is None and theirs(input_ids=ids).past_key_values is not None
    assert ours(input_ids=ids, use_cache=True).past_key_values is not None


def test_a_checkpoint_tensor_is_read_in_blocks_of_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large tensors are read block by block (materialize._copy_in_chunks); with a block of 2 rows here
    (the real one is 16 MiB) a whole tensor, a tile's block of it and a shard's slice of it equal the
    saved values, and no read asks for more than a block's bytes."""
    import torch
    from safetensors.torch import save_file

    from lightning_par.parallel.init import materialize
    from lightning_par.parallel.init.weights import SafetensorsWeights, WeightRef

    full = torch.arange(11 * 6, dtype=torch.float32).reshape(11, 6)
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    weights = SafetensorsWeights(tmp_path)
    reads: list[tuple[slice, ...]] = []
    real_read = weights.read
    monkeypatch.setattr(weights, "read", lambda key, index=None: reads.append(index) or real_read(key, index))
    monkeypatch.setattr(materialize, "_CHUNK_BYTES", 2 * 6 * 4)
    ref = WeightRef(weights, "w")

    whole = torch.full_like(full, float("nan"))
    materialize._copy_local(whole, ref)
    torch.testing.assert_close(whole, full, rtol=0, atol=0)
    tile = torch.full((5, 6), float("nan"))
    materialize._copy_local(tile, ref, (slice(4, 9),))  # a tile: rows 4..8 of the untiled weight
    torch.testing.assert_close(tile, full[4:9], rtol=0, atol=0)
    shard = torch.full((7, 4), float("nan"))
    materialize._copy_in_chunks(shard, ref, [slice(3, 10), slice(1, 5)])  # a 2-D block, as a DTensor shard's
    torch.testing.assert_close(shard, full[3:10, 1:5], rtol=0, atol=0)
    sizes = [(i[0].stop - i[0].start) * (i[1].stop - i[1].start) * 4 for i in reads]
    assert len(reads) == 6 + 3 + 3 and max(sizes) <= 2 * 6 * 4, reads  # 2 rows of 6, or 3 rows of the 4 columns
