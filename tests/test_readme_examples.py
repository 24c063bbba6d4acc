"""The README's "Use your own model" examples run as written: each ```python block of that section is
saved as the file its first comment names and run with ``python <file>`` from an empty directory
(Lightning starts the second rank by re-running the script, as it would for a user)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_examples() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
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


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["my_train.py", "my_lm.py", "my_tower.py"])
def test_readme_example_runs(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text(readme_examples()[name])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, name], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stopped = proc.stdout.count("`Trainer.fit` stopped") + proc.stderr.count("`Trainer.fit` stopped")
    assert stopped == (2 if name == "my_tower.py" else 1), proc.stderr[-3000:]
