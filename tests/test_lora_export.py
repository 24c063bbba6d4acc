"""A LoRA run's checkpoints out (issue 33, item 4): merged by default, or as a PEFT adapter.

A tiny Llama written with ``save_pretrained`` (made here, no download) is fine-tuned with ``model.lora.rank=4``
for 3 steps by the app (``run.py``) under single and under fsdp at 2 ranks, its checkpoint saved, and
exported at the end (``callbacks.export.at_end``). Then:

- the base weights in the checkpoint are bit-identical to the saved base (only the adapters trained);
- ``lightning-par-export CKPT OUT`` writes the merged plain model: transformers' ``from_pretrained`` loads it
  with no missing or unexpected key, and its logits are the trained model's (the checkpoint's tensors in
  the base architecture with lightning_par's own LoRA layers: the unmerged forward); so is the export at
  the end of training;
- ``lightning-par-export --adapter CKPT OUT`` writes PEFT's adapter directory: ``PeftModel.from_pretrained``
  loads it onto the original base with no adapter key missing, and gives the same logits.

Quick, in this process: transformers' ``save_pretrained`` of a LoRA model (not sharded) writes it merged;
the key helpers of ``lora_export``; a hand-written checkpoint's merge, and the one-line refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_par import ConfigError
from lightning_par.parallel.adapters.lora import LoRAConfig, apply_lora
from lightning_par.strategies.checkpoint import export, lora_export
from tests.helpers import run_cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process: the point

RANK, ALPHA = 4, 16.0
TRAIN = ["model=hf_causal_lm", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA:g}", "model.lr=1e-2",
         "data=synthetic", "data.seq_len=32", "data.global_batch_size=8", "trainer.max_steps=3",
         "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "check_memory=false",
         "callbacks.export.at_end=true"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_par.tools.tiny_checkpoint import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory.mktemp("lora") / "base")


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def _logits(net: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return net(input_ids=_ids()).logits


def _trained_model(base: Path, checkpoint: Path) -> torch.nn.Module:
    """The run's model: the base architecture with lightning_par's LoRA layers (unmerged) holding every tensor
    of the checkpoint (and nothing else: the key sets are equal)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    apply_lora(net, LoRAConfig(rank=RANK, alpha=ALPHA), exclude=[net.get_output_embeddings()])
    state = {"net." + k: v for k, v in net.state_dict().items()}
    saved = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    assert {"model." + k for k in state} == {k for k in saved if k.startswith("model.")}
    dcp.load({"model": state}, checkpoint_id=checkpoint, no_dist=True)
    return net.eval()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", [["strategy=single"], ["strategy=fsdp", "trainer.devices=2"]],
                         ids=["single", "fsdp"])
def test_a_lora_run_exports_merged_and_as_a_peft_adapter(base: Path, tmp_path: Path, strategy: list[str],
                                                         capsys: pytest.CaptureFixture) -> None:
    from peft import PeftModel
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    run_cli([*TRAIN, *strategy, f"model.pretrained={base}", f"callbacks.export.output_dir={tmp_path / 'at_end'}"], run)
    checkpoint = run / "checkpoints" / "step000003.ckpt"
    trained = _trained_model(base, checkpoint)
    want = _logits(trained)

    # the frozen base: bit for bit the saved one; the adapters did train (the test would pass without them else)
    state = trained.state_dict()
    for name, saved in load_file(base / "model.safetensors").items():
        assert torch.equal(state[name].flatten().view(torch.uint8), saved.flatten().view(torch.uint8)), name
    assert (want - _logits(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32))).abs().max() > 1e-2

    # merged (the default), by the command and at the end of training: the plain model, the trained logits
    assert export.main([str(checkpoint), str(tmp_path / "merged")]) == 0
    assert "28 LoRA layers merged" in capsys.readouterr().out  # 2 layers x 7 projections
    for directory in (tmp_path / "merged", tmp_path / "at_end"):
        with safe_open(directory / "model.safetensors", "pt") as f:
            assert not [k for k in f.keys() if "lora" in k]
        merged, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
        assert not any(info.values()), info  # no missing, unexpected or mismatched key
        torch.testing.assert_close(_logits(merged), want, rtol=1e-5, atol=1e-5)

    # the PEFT adapter, onto the original base
    adapter = tmp_path / "adapter"
    assert export.main(["--adapter", str(checkpoint), str(adapter)]) == 0
    assert "PEFT LoRA adapter (r=4, alpha=16" in capsys.readouterr().out
    config = json.loads((adapter / "adapter_config.json").read_text())
    fields = ("peft_type", "task_type", "r", "lora_alpha", "base_model_name_or_path", "fan_in_fan_out", "bias")
    assert [config[f] for f in fields] == ["LORA", "CAUSAL_LM", RANK, ALPHA, str(base), False, "none"]
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert config["target_modules"] == sorted(projections)
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        assert set(f.keys()) == {"base_model.model." + k for k in state if ".lora_" in k}
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    again = peft.load_adapter(adapter, adapter_name="again")  # what PEFT found missing or unexpected
    assert not [k for k in again.missing_keys if ".lora_" in k and ".again." in k] and not again.unexpected_keys
    torch.testing.assert_close(_logits(peft), want, rtol=1e-5, atol=1e-5)


def test_save_pretrained_of_a_lora_model_writes_it_merged(tmp_path: Path) -> None:
    """transformers' own ``save_pretrained`` on a LoRA model that is whole in this process (single, ddp, zero1,
    zero2) is replaced by one that writes the merged plain model (``parallel/hf/save.py``)."""
    from transformers import AutoModelForCausalLM

    from lightning_par.parallel.hf.save import install_sharded_save
    from tests.helpers import tiny_causal_lm

    _, net = tiny_causal_lm("llama")
    apply_lora(net, LoRAConfig(rank=RANK, alpha=ALPHA), exclude=[net.get_output_embeddings()])
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    holder = torch.nn.Module()
    holder.net = net
    assert install_sharded_save(holder) == 1 and "save_pretrained" in vars(net)
    net.save_pretrained(tmp_path / "out")
    merged, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.randint(0, net.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = net(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        assert (merged.model.layers[0].self_attn.q_proj.weight
                == net.model.layers[0].self_attn.q_proj.merged_weight()).all()


def test_lora_keys() -> None:
    names = ["net.a.q.weight", "net.a.q.bias", "net.a.q.lora_A.weight", "net.a.q.lora_B.weight", "net.a.norm.weight",
             "net.head.weight"]
    assert lora_export.adapted_weights(names) == {"net.a.q.weight": ("net.a.q.lora_A.weight", "net.a.q.lora_B.weight")}
    assert lora_export.adapter_keys("net.a.q.weight") == ("net.a.q.lora_A.weight", "net.a.q.lora_B.weight")
    with pytest.raises(ValueError, match="has net.a.q.lora_A.weight but no net.a.q.lora_B.weight"):
        lora_export.adapted_weights(names[:3])
    with pytest.raises(ValueError, match="has net.a.q.lora_B.weight but no net.a.q.lora_A.weight"):
        lora_export.adapted_weights([names[0], names[3]])
    assert lora_export.peft_names(names, "net.", train=["norm"]) == {
        "base_model.model.a.q.lora_A.weight": "net.a.q.lora_A.weight",
        "base_model.model.a.q.lora_B.weight": "net.a.q.lora_B.weight",
        "base_model.model.a.norm.weight": "net.a.norm.weight"}
    # leaf names when they name exactly the adapted layers; else the paths, as a regular expression PEFT matches whole
    modules = ["", "l.0.q", "l.0.k", "l.1.q", "l.1.k", "head"]
    assert lora_export.target_modules(["l.0.q", "l.1.q"], modules) == ["q"]
    assert lora_export.target_modules(["l.0.q"], modules) == r"^(?:l\.0\.q)$"
    w, a, b = torch.randn(6, 5), torch.randn(2, 5), torch.randn(6, 2)
    torch.testing.assert_close(lora_export.merge(w, a, b, 8.0), w + 8.0 * b @ a)


def _checkpoint(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
    """A lightning_par checkpoint directory holding ``tensors`` as its model and ``meta`` as its meta.pt."""
    import torch.distributed.checkpoint as dcp

    path.mkdir(parents=True)
    torch.save(meta, path / "meta.pt")
    dcp.save({"model": tensors}, checkpoint_id=path, no_dist=True)
    return path


def test_a_merged_export_of_any_model_and_the_refusals(tmp_path: Path) -> None:
    """A model without a transformers layout is written under its own names, merged; ``--adapter`` wants a
    Hugging Face model's LoRA checkpoint, and a half adapter or one without its rank is one line."""
    from safetensors.torch import load_file

    w, a, b = torch.randn(6, 5), torch.randn(2, 5), torch.randn(6, 2)
    lora = {"lin.weight": w, "lin.lora_A.weight": a, "lin.lora_B.weight": b, "lin.bias": torch.randn(6)}
    ckpt = _checkpoint(tmp_path / "lora.ckpt", lora, {"lora": {"rank": 2, "alpha": 4.0}})
    assert "1 LoRA layers merged" in export.export(ckpt, tmp_path / "out")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == {"lin.weight", "lin.bias"}
    torch.testing.assert_close(got["lin.weight"], w + 2.0 * b @ a)
    # from the module's hyper-parameters when meta.pt has no lora (a checkpoint written before it did)
    ckpt = _checkpoint(tmp_path / "hp.ckpt", lora, {"hyper_parameters": {"lora": {"rank": 2, "alpha": 6}}})
    export.export(ckpt, tmp_path / "hp")
    torch.testing.assert_close(load_file(tmp_path / "hp" / "model.safetensors")["lin.weight"], w + 3.0 * b @ a)

    cases = {
        ("plain.ckpt", "lin.weight", "lin.bias"): (True, "holds no LoRA adapters"),
        ("gpt.ckpt", *lora): (True, "is not a Hugging Face model's"),
        ("half.ckpt", "lin.weight", "lin.lora_A.weight"): (False, "has lin.lora_A.weight but no lin.lora_B.weight"),
        ("norank.ckpt", *lora): (False, "records no lora rank and alpha"),
    }
    for (name, *keys), (adapter, expected) in cases.items():
        meta = {} if name == "norank.ckpt" else {"lora": {"rank": 2, "alpha": 4.0}}
        ckpt = _checkpoint(tmp_path / name, {k: lora[k] for k in keys}, meta)
        with pytest.raises(ConfigError, match=expected):
            export.export(ckpt, tmp_path / f"{name}.out", adapter=adapter)
        assert not (tmp_path / f"{name}.out").exists()
