"""The installed app: ``lightning-par``, ``python -m lightning_par`` and ``python run.py`` are one command,
and a wheel (a non-editable install) works from an empty directory, configs and child ranks included."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent  # where pip put this environment's console scripts
ENTRY_POINTS = {"console script": [str(BIN / "lightning-par")], "module": [sys.executable, "-m", "lightning_par"],
                "run.py": [sys.executable, str(ROOT / "run.py")]}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0", **extra)


def _run(cmd: list, cwd: Path, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or _env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=list(ENTRY_POINTS))
def test_every_entry_point_runs_a_sweep(entry, tmp_path):
    """The same two-job sweep (memory estimates, no training) from each entry point, run from a
    directory that is not the checkout: same jobs, same directories, the packaged configs."""
    sweep = tmp_path / "sweep"
    proc = _run([*ENTRY_POINTS[entry], "-m", "mode=estimate", "model=gpt_tiny", "trainer.devices=2,4",
                 f"hydra.sweep.dir={sweep}"], tmp_path, timeout=180)
    assert proc.stdout.count("zero3_offload") == 2, proc.stdout[-3000:]  # one table per job
    for job, devices in (("0", 2), ("1", 4)):
        overrides = (sweep / job / ".hydra" / "overrides.yaml").read_text()
        assert f"trainer.devices={devices}" in overrides and (sweep / job / "run.log").exists()


def test_wheel_installs_and_runs_from_an_empty_directory(tmp_path):
    """``pip wheel --no-deps .`` builds the wheel (pip's default isolated build: it fetches setuptools
    from the package index, as a user's ``pip install`` does). It goes into a fresh virtual environment
    that borrows this environment's dependencies (torch, Lightning, Hydra, ...) through a ``.pth`` line
    instead of installing them again. Python runs the ``.pth`` files of site directories only, not
    of directories a ``.pth`` line adds, so this environment's editable lightning_par (an ``.pth``
    hook) cannot shadow the wheel there -- checked below. Then, from an empty directory: a 2-rank
    DDP run (rank 1 is ``python -m lightning_par.run.child`` of the installed package) and its report."""
    src = tmp_path / "src"  # the files the wheel is built from, so no build/ lands in the checkout
    shutil.copytree(ROOT / "lightning_par", src / "lightning_par", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", tmp_path / "dist", "."], src, 600)
    (wheel,) = (tmp_path / "dist").glob("lightning_par-*.whl")
    packed = zipfile.ZipFile(wheel).namelist()
    for f in ("lightning_par/conf/__init__.py", "lightning_par/conf/config.yaml", "lightning_par/conf/strategy/ddp.yaml",
              "lightning_par/conf/hydra/launcher/slurm.yaml", "lightning_par/run/child.py", "lightning_par/tools/report.py"):
        assert f in packed, f

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, 120)
    python = venv / "bin" / "python"
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        tmp_path, 60).stdout.strip())
    (purelib / "borrowed_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "--quiet", wheel],
         tmp_path, 300)

    empty = tmp_path / "empty"
    empty.mkdir()
    env = _env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    where = _run([python, "-c", "import lightning_par; print(lightning_par.__file__)"], empty, 60, env).stdout.strip()
    assert Path(where).is_relative_to(purelib), f"lightning_par imported from {where}, not from the wheel"

    _run(["lightning-par", "strategy=ddp", "trainer.devices=2", "experiment=quick", "trainer.max_steps=5"],
         empty, 300, env)
    (summary_file,) = empty.glob("outputs/*/*/summary.json")
    summary = json.loads(summary_file.read_text())
    # rank 1 ran (``python -m lightning_par.run.child``, from the wheel: the checkout is not on its path) and reported
    assert summary["world_size"] == 2 and summary["steps"] == 5 and [m["rank"] for m in summary["memory"]] == [0, 1]
    run_dir = summary_file.parent

    proc = _run(["lightning-par-report", run_dir], empty, 120, env)
    assert "1 run(s), 0 failed job(s)" in proc.stdout
    assert "| . | ddp | 2 |" in (run_dir / "report.md").read_text()
    assert sorted(p.name for p in empty.iterdir()) == ["outputs"]  # nothing else written into the directory
