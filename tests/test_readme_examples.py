"""The "Use your own model" examples (docs/your-model.md, linked from the README's section of that name)
run as written: each ```python block of that page is saved as the file its first comment names and run
with ``python <file>`` from an empty directory (Lightning starts the second rank by re-running the
script, as it would for a user)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests import launch

ROOT = Path(__file__).resolve().parents[1]


def readme_examples() -> dict[str, str]:
    text = (ROOT / "docs" / "your-model.md").read_text()
    section = text.split("## Use your own model", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    out = {}
    for code in blocks:
        first = code.splitlines()[0]
        match = re.match(r"# (\S+\.py) -- python \1", first)
        assert match, f"example does not start with '# NAME.py -- python NAME.py': {first!r}"
        out[match.group(1)] = code
    return out


def test_readme_has_the_three_cases() -> None:
    assert sorted(readme_examples()) == ["my_lm.py", "my_tower.py", "my_train.py"]
    readme = (ROOT / "README.md").read_text()  # the README's own section points at them
    assert "](docs/your-model.md)" in readme.split("## Use your own model", 1)[1].split("\n## ", 1)[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["my_train.py", "my_lm.py", "my_tower.py"])
def test_readme_example_runs(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text(readme_examples()[name])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = launch.run([sys.executable, name], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stopped = proc.stdout.count("`Trainer.fit` stopped") + proc.stderr.count("`Trainer.fit` stopped")
    assert stopped == (2 if name == "my_tower.py" else 1), proc.stderr[-3000:]
    if name == "my_lm.py":
        check_measured(tmp_path / "run" / "summary.json", proc.stdout)


def check_measured(path: Path, stdout: str) -> None:
    """my_lm.py's callbacks in a plain Trainer (issue 34): summary.json with a non-null MFU for a Hugging Face
    model without the app's meta-copy protocol. Its FLOPs are those of the step it ran: torch's FlopCounterMode
    over forward + backward of the same Llama, unsharded, on the global batch (2 ranks x 4 samples of 32
    tokens) here in one process -- equal; and within 5% of 6 x non-embedding parameters x tokens."""
    import json

    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    s = json.loads(path.read_text())
    assert s["model"] == "MyLM" and "FSDPMyLM" not in stdout  # the user's class, not FSDP's dynamic subclass
    assert s["strategy"] == "FSDPStrategy" and s["world_size"] == 2 and s["global_batch_size"] == 8
    assert s["steps"] == 10 and len(s["losses"]) == 10 and s["memory"] and len(s["memory"]) == 2
    assert s["flops_method"] == "measured step" and "mfu_note" not in s
    step = s["step_time_s"]
    assert s["mfu"] == pytest.approx(s["flops_per_step"] / step / (1.0e12 * 2), rel=1e-9)  # peak_tflops=1.0, 2 ranks
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    lm = LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (8, 32))
    with FlopCounterMode(display=False) as counter:
        lm(input_ids=ids, labels=ids).loss.backward()
    assert s["flops_per_step"] == counter.get_total_flops() > 0
    non_embedding = sum(p.numel() for p in lm.parameters()) - lm.model.embed_tokens.weight.numel()
    assert s["flops_per_step"] == pytest.approx(6 * non_embedding * 8 * 32, rel=0.05)
