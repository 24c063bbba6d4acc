"""Bad input stops with a one-line error before any process starts."""

from __future__ import annotations

import time

import pytest
from omegaconf import OmegaConf

from lightning_par import ConfigError
from lightning_par.data import TextDataModule
from lightning_par.models import GPTModule
from lightning_par.strategies import DDPStrategy
from lightning_par.run.train import validate
from tests.helpers import run_cli


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["strategy=zer3"], r"unknown strategy 'zer3'; choose from: .*ddp.*single"),
        (["-m", "strategy=ddp,nope"], r"unknown strategy 'nope'"),
        (["model=gpt5"], r"unknown model 'gpt5'; choose from: .*gpt_small"),
        (["data=imagenet"], r"unknown data 'imagenet'; choose from: .*text"),
        (["strategy=ddp", "trainer.devices=2", "data.global_batch_size=7"], r"global_batch_size=7 is not divisible"),
        (["trainer.precision=fp8"], r"unknown precision 'fp8'; choose from: .*bf16-mixed"),
        (["trainer.precision=16-mixed"], r"needs a GPU"),
        (["model=mlp"], r"takes vectors but data TextDataModule gives tokens"),
        (["model=gpt_tiny", "data=synthetic", "data.vocab_size=1000"],
         r"the data's vocabulary \(1000 ids, SyntheticTokens\) is larger than the model's \(256\)"),
        (["model=hf_causal_lm", "model.pretrained=/nonexistent/llama"],
         r"pretrained model: /nonexistent/llama is not a directory"),
        (["model.preset=gpt9"], r"unknown preset 'gpt9'"),
        (["model=cnn", "data=images", "strategy=pipeline", "trainer.devices=2", "+trainer.sync_batchnorm=true"],
         r"PipelineStrategy: sync_batchnorm cannot give BatchNorm the statistics of the global batch"),
        (["mode=serve"], r"unknown mode 'serve'"),
        (["-m", "strategy=ddp,fsdp", "strategy.param_dtype=bf16"],
         r"strategy.param_dtype: strategy=ddp has no option 'param_dtype' \(swept: ddp, fsdp\)"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, pattern):
    start = time.monotonic()
    proc = run_cli(args, tmp_path / "run", timeout=60, check=False)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    import re

    assert re.search(pattern, lines[0]), lines[0]
    assert not (tmp_path / "run" / "summary.json").exists()
    assert time.monotonic() - start < 30  # stopped before training, not after


def _cfg(**trainer):
    return OmegaConf.create({"trainer": {"accelerator": "cuda", "devices": 4, "num_nodes": 1,
                                         "precision": "32-true", **trainer},
                             "data": {"global_batch_size": 8}})


def test_more_devices_than_gpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"trainer.devices=4 but this machine has 2 GPU\(s\)"):
        validate(_cfg(), DDPStrategy(), GPTModule(preset="gpt_tiny"), TextDataModule())


def test_a_swept_groups_own_option_reaches_every_job(tmp_path):
    """Hydra composes a sweep's base config with the default strategy (single, which has no
    param_dtype) and failed on the key before any job; every swept config has it, so each job gets it."""
    import json

    sweep = tmp_path / "sweep"
    run_cli(["-m", "mode=estimate", "strategy=fsdp,zero3", "strategy.param_dtype=bf16", "trainer.devices=2",
             f"hydra.sweep.dir={sweep}"], sweep, timeout=120)
    jobs = [OmegaConf.load(sweep / job / ".hydra" / "config.yaml") for job in ("0", "1")]
    assert [(c.strategy._target_.rsplit(".", 1)[1], c.strategy.param_dtype) for c in jobs] == [
        ("FSDPStrategy", "bf16"), ("Zero3Strategy", "bf16")]
    assert all(json.loads((sweep / job / "estimate.json").read_text()) for job in ("0", "1"))


@pytest.mark.timeout(120)
def test_a_token_file_vocabulary_larger_than_a_pretrained_model_is_one_line(tmp_path):
    """The user's real job: a local checkpoint and a corpus tokenized with another (larger) tokenizer --
    one line before launch, naming both vocabularies, for the app's own GPT and a pretrained directory."""
    import numpy as np
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_par.core.token_format import pack_header

    tokens = np.arange(4000, dtype=np.uint16) % 1000
    corpus = tmp_path / "corpus.bin"
    with open(corpus, "wb") as f:
        f.write(pack_header(len(tokens), tokens.dtype, 1000))
        f.write(tokens.tobytes())
    llama = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                 vocab_size=300)).save_pretrained(llama)
    for i, (model, theirs) in enumerate(((["model=gpt_tiny"], 256),
                                         (["model=hf_causal_lm", f"model.pretrained={llama}"], 300))):
        proc = run_cli([*model, "data=tokens", f"data.path={corpus}", "data.seq_len=16"], tmp_path / f"run{i}",
                       timeout=90, check=False)
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
        assert f"the data's vocabulary (1000 ids, TokenFileDataModule {corpus}) is larger than the model's ({theirs})" \
            in lines[0], lines[0]
        assert not (tmp_path / f"run{i}" / "summary.json").exists()
