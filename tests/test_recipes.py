"""The recipes (docs/huggingface.md) run as written (issue 20, part 4), scaled down to CPU and 2 or 4 ranks.

The test makes the assets a user would bring, offline, as that page says to make them
(``lightning_par.tools.tiny_checkpoint``): a BPE tokenizer trained with the ``tokenizers`` library on
local text, a tiny Llama and a tiny GPT-2 saved with ``save_pretrained`` together with that tokenizer (as
a model directory usually holds both), and a jsonl corpus. Then every command of each ```bash block of
docs/huggingface.md's "Recipes" section runs in that directory, in order, exactly as written; each must exit 0,
and the exported models must load in transformers.

The README's "Fine-tune a pretrained checkpoint" section's first block runs the same way from an empty
directory: it makes its own tiny checkpoint, fine-tunes it, exports it, loads it (issue 34).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests import launch

ROOT = Path(__file__).resolve().parents[1]

# what the recipes' commands make (docs/huggingface.md): python -m lightning_par.tools.tiny_checkpoint llama --corpus corpus.jsonl,
# and ... gpt2 --arch gpt2
ASSETS = ("import sys; from lightning_par.tools.tiny_checkpoint import tiny_checkpoint as make; out = sys.argv[1]; "
          "make(f'{out}/llama', 'llama', corpus=f'{out}/corpus.jsonl'); make(f'{out}/gpt2', 'gpt2')")


def bash_blocks(heading: str, page: str = "README.md") -> list[list[str]]:
    """The commands of each ```bash block of the section under ``heading`` of ``page`` (README.md, or a
    docs/ page; continuation lines joined, comments dropped)."""
    text = (ROOT / page).read_text()
    section = text.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        commands = []
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
        blocks.append(commands)
    return blocks


def recipes() -> list[str]:
    """The commands of the Recipes section (docs/huggingface.md), in order."""
    return [c for block in bash_blocks("Recipes", "docs/huggingface.md") for c in block]


def run_as_written(commands: list[str], cwd: Path, env: dict[str, str]) -> None:
    for command in commands:
        args = shlex.split(command)
        if args[0] == "python":
            args[0] = sys.executable
        done = launch.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def user_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the venv's console scripts
    return env


def test_the_recipes_section_holds_both_recipes() -> None:
    commands = recipes()
    assert any("strategy=fsdp" in c and "model.pretrained=" in c for c in commands), commands
    assert any("strategy=3d" in c and "data=tokens" in c for c in commands), commands
    assert sum(c.startswith("lightning-par-prepare") for c in commands) >= 1, commands


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_readme_recipes_run_as_written(tmp_path: Path) -> None:
    env = user_env()
    done = launch.run([sys.executable, "-c", ASSETS, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run_as_written(recipes(), tmp_path, env)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for exported in ("finetune/hf", "gpt2-continued"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / exported)
        tokenizer = AutoTokenizer.from_pretrained(tmp_path / exported)  # the run's tokenizer travelled with it
        assert len(tokenizer) <= model.config.vocab_size < len(tokenizer) + 64
    summary = json.loads((tmp_path / "finetune" / "summary.json").read_text())
    assert summary["losses"][-1] < summary["losses"][0], summary["losses"]


def test_the_fine_tune_section_starts_from_nothing() -> None:
    (first, *_) = bash_blocks("Fine-tune a pretrained checkpoint")
    assert first[0].startswith("python -m lightning_par.tools.tiny_checkpoint "), first
    assert any("model.pretrained=" in c for c in first) and any(c.startswith("lightning-par-export ") for c in first)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_fine_tune_section_runs_as_written(tmp_path: Path) -> None:
    """From an empty directory: the tiny checkpoint made as the README shows, the fine-tune under fsdp on 2
    ranks, the export of its checkpoint (which a fine-tune writes by default), transformers loading it. And
    what a fine-tune gets by default: an LR warmed up to 5e-5 and decayed, checkpoints, the source's
    generation config in the export, the source named in summary.json."""
    (commands, *_) = bash_blocks("Fine-tune a pretrained checkpoint")
    run_as_written(commands, tmp_path, user_env())
    from transformers import AutoModelForCausalLM

    source = tmp_path / "tiny-llama"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "my-model")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 320
    assert json.loads((tmp_path / "my-model" / "generation_config.json").read_text()) == \
        json.loads((source / "generation_config.json").read_text())
    run = tmp_path / "finetune"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["pretrained"] == str(source) and summary["steps"] == 50
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step000050.ckpt"]  # the last step's
    with open(run / "csv" / "metrics.csv") as f:
        lrs = [float(r["train/lr"]) for r in csv.DictReader(f) if r.get("train/lr")]
    # logged every 10 steps (steps 9, 19, ...): past a 5-step warm-up, decaying linearly from 5e-5 towards 0
    assert len(lrs) == 5 and lrs[0] == pytest.approx(5e-5 * (1 - 4 / 45), rel=1e-4), lrs
    assert all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] < 2e-6, lrs


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fine_tune_on_token_files_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    """data=tokens under fsdp x2, a checkpoint at step 4 of 8 (mid-epoch), resumed under ddp x2: steps 5-8
    give the uninterrupted run's losses (rtol 1e-5), from the loaded pretrained Llama."""
    import numpy as np

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = launch.run([sys.executable, "-c", ASSETS, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    done = launch.run([sys.executable, "-m", "lightning_par.tools.prepare", "corpus.jsonl", "--tokenizer", "llama",
                           "--out", "corpus.bin", "--workers", "1"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    common = ["model=hf_causal_lm", "model.pretrained=llama", "data=tokens", "data.path=corpus.bin", "data.seq_len=32",
              "data.global_batch_size=8", "trainer.devices=2", "trainer.max_steps=8", "trainer.limit_val_batches=0"]

    def run(name: str, *extra: str) -> list[float]:
        done = launch.run([sys.executable, str(ROOT / "run.py"), *common, *extra, f"hydra.run.dir={name}"],
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_lora_section_runs_as_written(tmp_path: Path) -> None:
    """The README's LoRA and QLoRA block from an empty directory: QLoRA under fsdp on 2 ranks, both exports,
    transformers generating from the merged model, PEFT loading the adapter. Then the exports agree: the merged
    model's logits equal PEFT's adapter on the NF4 base's dequantized values (rtol 1e-5), the base the run trained on."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lightning_par.parallel.adapters.lora import DEFAULT_TARGETS, to_nf4

    (commands, *_) = bash_blocks("LoRA and QLoRA")
    assert any("model.lora.base=nf4" in c and "strategy=fsdp" in c for c in commands), commands
    run_as_written(commands, tmp_path, user_env())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "qlora-merged").eval()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama")
    with torch.no_grad():  # the values QLoRA trained on: each target weight through NF4 and back
        for name, p in base.named_parameters():
            if name.endswith(".weight") and name.rsplit(".", 2)[-2] in DEFAULT_TARGETS:
                p.copy_(to_nf4(p).get_original_weight())
    peft = PeftModel.from_pretrained(base, tmp_path / "qlora-adapter").eval()
    x = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        a, b = merged(input_ids=x).logits, peft(input_ids=x).logits
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama")(input_ids=x).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a, plain, atol=1e-4)  # training and quantization changed the model
