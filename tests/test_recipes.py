"""The README's recipes run as written (issue 20, part 4), scaled down to CPU and 2 or 4 ranks.

The test makes the assets a user would bring, offline: a BPE tokenizer trained here with the
``tokenizers`` library on local text, a tiny Llama and a tiny GPT-2 saved with ``save_pretrained``
together with that tokenizer (as a model directory usually holds both), and a jsonl corpus. Then
every command of each ```bash block of the README's "Recipes" section runs in that directory, in
order, exactly as written; each must exit 0, and the exported models must load in transformers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ASSETS = textwrap.dedent('''
    import json, random, sys, torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    out = sys.argv[1]
    rng = random.Random(0)
    words = ["data", "parallel", "shard", "gradient", "rank", "pipeline", "tensor", "expert", "model", "step",
             "loss", "memory", "token", "layer", "the", "a", "of", "and", "to", "is"]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) + "." for _ in range(400)]
    with open(f"{out}/corpus.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\\n")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    # a Llama (untied, grouped-query attention) and a GPT-2 (tied embeddings, fused Conv1D c_attn, learned
    # positions: transformers declares neither a tensor-parallel nor a pipeline plan for it)
    extra = {"llama": dict(num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False),
             "gpt2": dict(n_inner=128, tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)}
    for name, arch in (("llama", "llama"), ("gpt2", "gpt2")):
        torch.manual_seed(0)
        AutoConfig.for_model(arch).save_pretrained(f"{out}/{name}")
        fast.save_pretrained(f"{out}/{name}")
        tok = AutoTokenizer.from_pretrained(f"{out}/{name}")  # as the model type's class loads it
        cfg = AutoConfig.for_model(arch, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                   vocab_size=-(-len(tok) // 64) * 64,  # padded, as real checkpoints are (tp divides it)
                                   max_position_embeddings=128, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id, **extra[name])
        AutoModelForCausalLM.from_config(cfg).save_pretrained(f"{out}/{name}")
''')


def recipes() -> list[str]:
    """The commands of the README's Recipes section, in order (continuation lines joined)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Recipes", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def test_the_recipes_section_holds_both_recipes() -> None:
    commands = recipes()
    assert any("strategy=fsdp" in c and "model.pretrained=" in c for c in commands), commands
    assert any("strategy=3d" in c and "data=tokens" in c for c in commands), commands
    assert sum(c.startswith("lightning-par-prepare") for c in commands) >= 1, commands


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_readme_recipes_run_as_written(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the venv's console scripts
    done = subprocess.run([sys.executable, "-c", ASSETS, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for command in recipes():
        args = shlex.split(command)
        if args[0] == "python":
            args[0] = sys.executable
        done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for exported in ("finetune/hf", "gpt2-continued"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / exported)
        tokenizer = AutoTokenizer.from_pretrained(tmp_path / exported)  # the run's tokenizer travelled with it
        assert len(tokenizer) <= model.config.vocab_size < len(tokenizer) + 64
    summary = json.loads((tmp_path / "finetune" / "summary.json").read_text())
    assert summary["losses"][-1] < summary["losses"][0], summary["losses"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fine_tune_on_token_files_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    """data=tokens under fsdp x2, a checkpoint at step 4 of 8 (mid-epoch), resumed under ddp x2: steps 5-8
    give the uninterrupted run's losses (rtol 1e-5), from the loaded pretrained Llama."""
    import numpy as np

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", ASSETS, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run([sys.executable, "-m", "lightning_par.prepare", "corpus.jsonl", "--tokenizer", "llama",
                           "--out", "corpus.bin", "--workers", "1"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    common = ["model=hf_causal_lm", "model.pretrained=llama", "data=tokens", "data.path=corpus.bin", "data.seq_len=32",
              "data.global_batch_size=8", "trainer.devices=2", "trainer.max_steps=8", "trainer.limit_val_batches=0"]

    def run(name: str, *extra: str) -> list[float]:
        done = subprocess.run([sys.executable, str(ROOT / "run.py"), *common, *extra, f"hydra.run.dir={name}"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((tmp_path / name / "summary.json").read_text())["losses"]

    whole = run("whole", "strategy=fsdp", "callbacks=checkpoint", "callbacks.checkpoint.every_n_train_steps=4")
    resumed = run("resumed", "strategy=ddp", "ckpt_path=whole/checkpoints/step000004.ckpt")
    # the resumed summary carries the checkpoint's first 4 losses and its own 4 after them
    assert len(whole) == len(resumed) == 8, (whole, resumed)
    np.testing.assert_allclose(resumed[4:], whole[4:], rtol=1e-5, atol=1e-6)
    assert resumed[:4] == whole[:4]
    log = (tmp_path / "resumed" / "run.log").read_text()  # it did resume (a fresh 8-step run would match too)
    assert "Restored all states from the checkpoint at whole/checkpoints/step000004.ckpt" in log
