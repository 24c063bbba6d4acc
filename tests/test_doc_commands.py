"""Every command shown in README.md and docs/ (each line of a ```bash / ```console block) is run by a test
or checked here, so that a renamed option, group, flag or module fails the suite instead of a reader:

- the app (``python run.py ...``, ``lightning-par ...``, also after ``torchrun ... run.py``): the command's
  overrides go through the app's own checks before launch -- group names and field names (``cli.py``),
  Hydra composing the config, every value's type and range (``run/config_values.py``); a sweep (``-m``)
  value by value;
- the advisor and the estimate's command line: run in-process as written, exit 0;
- the other commands with flags (``lightning-par-report``/``-prepare``/``-export``, ``python -m
  lightning_par.tools.*``, ``python benchmarks/*.py``): the program exists and every ``--flag`` written is
  one of its own (its ``--help``);
- the sections a test runs as written, end to end (``RUN_BY``), and the commands no test here can run
  (``NOT_RUN``, each with its reason).

A command matching none of these fails ``test_every_command_is_covered``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests import launch
from tests.helpers import composed

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: (page, the start of a section's heading, as the test names it) -> the test file that runs that section's
#: commands as written, end to end
RUN_BY = {
    ("README.md", "Fine-tune a pretrained checkpoint"): "tests/test_recipes.py",
    ("docs/huggingface.md", "Recipes"): "tests/test_recipes.py",
}
#: commands no test here runs, by their start, and why
NOT_RUN = {
    "pip install": "the set-up commands: .ci/run runs the test one in a fresh venv; tests/test_install.py builds "
                   "and installs the wheel",
    "sbatch ": "needs a Slurm cluster; tests/test_slurm.py runs the script's launch on a stand-in cluster",
    "python -m lightning.pytorch.utilities.consolidate_checkpoint": "Lightning's own command",
    "python -c ": "a transformers one-liner on the user's exported directory (tests/test_recipes.py loads "
                  "the export the same way)",
}
IN_PROCESS = {"lightning-par-advise": "lightning_par.modes.advise", "python -m lightning_par.modes.advise":
              "lightning_par.modes.advise", "python -m lightning_par.modes.estimate": "lightning_par.modes.estimate"}
FLAGGED = {"lightning-par-report": [sys.executable, "-m", "lightning_par.tools.report"],
           "lightning-par-prepare": [sys.executable, "-m", "lightning_par.tools.prepare"],
           "lightning-par-export": [sys.executable, "-m", "lightning_par.strategies.checkpoint.export"]}


def commands() -> list[tuple[str, str, str]]:
    """(page relative to the repository, section heading, command) for every command line of every shell
    block: continuation lines joined, comments and a ``$ `` prompt dropped, ``cd DIR &&`` kept off."""
    out = []
    for page in PAGES:
        section = ""
        text = page.read_text()
        for part in re.split(r"(```(?:bash|sh|shell|console)\n.*?```)", text, flags=re.S):
            if not part.startswith("```"):
                heads = re.findall(r"^## (.+)$", part, flags=re.M)
                section = heads[-1].strip() if heads else section
                continue
            body = part.split("\n", 1)[1].rsplit("```", 1)[0].replace("\\\n", " ")
            for line in body.splitlines():
                line = line.split("  #", 1)[0].strip().removeprefix("$ ")
                if line and not line.startswith("#"):
                    out.append((str(page.relative_to(ROOT)), section, re.sub(r"^cd \S+ && ", "", line)))
    return out


def kind(page: str, section: str, command: str) -> str:
    if any(page == p and section.startswith(s) for p, s in RUN_BY):
        return "run_by"
    if command.startswith(("python run.py", "lightning-par ")) or command == "lightning-par" \
            or command.startswith("pip install") and command.endswith("&& lightning-par"):
        return "app"  # the install is .ci/run's; the command after it is checked
    if any(command.startswith(k) for k in NOT_RUN):
        return "not_run"
    if command.startswith("torchrun ") and " run.py " in command:
        return "app"
    if command.startswith("mkdir ") and "printf" in command:
        return "setup"  # a file the next command reads: run before it
    if command.split()[0] in IN_PROCESS or " ".join(command.split()[:3]) in IN_PROCESS:
        return "in_process"
    if command.split()[0] in FLAGGED or command.startswith(("python -m lightning_par.tools.", "python benchmarks/")):
        return "flagged"
    return "uncovered"


ALL = commands()


def test_the_pages_show_commands_of_every_kind() -> None:
    """The reader finds the commands this file checks (a parser that found none would pass everything)."""
    kinds = [kind(*c) for c in ALL]
    assert len(ALL) > 60 and {"app", "in_process", "flagged", "run_by", "not_run"} <= set(kinds), kinds


def test_every_command_is_covered() -> None:
    uncovered = [f"{p} ({s}): {c}" for p, s, c in ALL if kind(p, s, c) == "uncovered"]
    assert not uncovered, "commands no test runs or checks:\n" + "\n".join(uncovered)


def test_the_sections_run_by_a_test_are_read_by_it() -> None:
    """A section named in RUN_BY is one the named test reads by its heading (renaming it fails here)."""
    for (page, section), test in RUN_BY.items():
        assert any(p == page and s.startswith(section) for p, s, _ in ALL), (page, section)
        source = (ROOT / test).read_text()
        assert f'"{section}"' in source and (page == "README.md" or f'"{page}"' in source), (page, section, test)


def _app_argv(command: str) -> list[str]:
    words = shlex.split(command.split("&&")[-1] if "pip install" in command else command)
    if words[0] == "torchrun":
        words = words[words.index("run.py"):]
    start = 2 if words[:2] == ["python", "run.py"] else 1
    return [w for w in words[start:] if w != "-m"]


def _sweep_jobs(argv: list[str]) -> list[list[str]]:
    """One argv per job of a sweep, each value of each swept key at least once (not the full product)."""
    from lightning_par.cli import _choices, _parsed_overrides

    parsed = _parsed_overrides(argv)
    swept = {}
    if parsed is not None:
        for o in parsed[1]:
            if o.is_sweep_override():
                swept[o.input_line] = [f"{o.key_or_group}={v}" for v in _choices(o)]
    n = max((len(v) for v in swept.values()), default=1)
    return [[(swept[a][i % len(swept[a])] if a in swept else a) for a in argv] for i in range(n)]


def check_app_command(command: str, tmp: Path) -> None:
    """The app's checks before launch on ``command``'s overrides, job by job; raises what the app would."""
    from lightning_par.cli import check_field_names, check_group_choices
    from lightning_par.run.config_values import check_config_values

    for job in _sweep_jobs(_app_argv(command)):
        job = [a.replace("<day>", "2026-11-27").replace("<time>", "12-00-00") for a in job]
        check_group_choices(job)
        check_field_names(job)
        if any(a.lstrip("'").startswith(("hydra.searchpath", "hydra/launcher=")) for a in job):
            continue  # composing needs the user's directory on Hydra's search path, or the slurm extra's
            # launcher plugin: the group and field checks above read them
        check_config_values(composed(*(a for a in job if not a.startswith("hydra.")), tmp=tmp))


@pytest.mark.parametrize("page,section,command", [c for c in ALL if kind(*c) == "app"],
                         ids=lambda v: v if len(v) < 60 else v[:60])
def test_app_commands_pass_the_checks_before_launch(page: str, section: str, command: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for line in (c for p, s, c in ALL if kind(p, s, c) == "setup" and p == page and s == section):
        subprocess.run(["bash", "-c", line], check=True)  # the file the command reads (a logger's yaml)
    check_app_command(command, tmp_path)


@pytest.mark.parametrize("command", ["python run.py strategy=zer3", "python run.py trainer.max_stpes=2",
                                     "python run.py -m strategy=ddp,fsdp trainer.devices=0",
                                     "lightning-par experiment=quick data.seq_len=0"])
def test_the_app_check_refuses_a_broken_command(command: str, tmp_path: Path) -> None:
    from lightning_par import ConfigError

    with pytest.raises(ConfigError):
        check_app_command(command, tmp_path)


def _advisor_inputs(tmp: Path) -> None:
    """The files the advisor's documented commands read: a Llama-3-8B config.json and a 1B checkpoint's
    config (the shapes of those models' published configs)."""
    from transformers import LlamaConfig

    eight = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192)
    (tmp / "Meta-Llama-3-8B").mkdir()
    (tmp / "Meta-Llama-3-8B" / "config.json").write_text(eight.to_json_string())
    one = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                      max_position_embeddings=131072)
    (tmp / "checkpoints" / "llama-1b").mkdir(parents=True)
    (tmp / "checkpoints" / "llama-1b" / "config.json").write_text(one.to_json_string())
    (tmp / "checkpoints" / "llama-1b" / "model.safetensors").write_bytes(b"")


@pytest.mark.parametrize("page,section,command", [c for c in ALL if kind(*c) == "in_process"],
                         ids=lambda v: v if len(v) < 60 else v[:60])
def test_advisor_and_estimate_commands_run(page: str, section: str, command: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    monkeypatch.chdir(tmp_path)
    _advisor_inputs(tmp_path)
    words = shlex.split(command)
    n = 1 if words[0] in IN_PROCESS else 3
    module = importlib.import_module(IN_PROCESS[" ".join(words[:n])])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            module.main(words[n:])
        except SystemExit as e:  # argparse's refusal, or the command's own one-line error
            pytest.fail(f"{command}: exit {e.code}\n{out.getvalue()[-2000:]}")
    assert out.getvalue().strip(), command


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_commands_with_flags_name_their_programs_flags() -> None:
    """Each program's --help, once; every flag the pages write is in it."""
    helps: dict[str, str] = {}
    missing = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for page, section, command in (c for c in ALL if kind(*c) == "flagged"):
        words = shlex.split(command)
        if words[0] in FLAGGED:
            program, args = FLAGGED[words[0]], words[1:]
        elif words[:2] == ["python", "-m"]:
            program, args = [sys.executable, "-m", words[2]], words[3:]
        else:
            program, args = [sys.executable, str(ROOT / words[1])], words[2:]
        key = json.dumps(program)
        if key not in helps:
            proc = launch.run([*program, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, f"{' '.join(program)} --help: {proc.stderr[-1500:]}"
            helps[key] = proc.stdout
        for flag in (a.split("=", 1)[0] for a in args if a.startswith("--")):
            if flag not in helps[key]:
                missing.append(f"{page} ({section}): {command}: {flag}")
    assert len(helps) >= 5 and not missing, missing
