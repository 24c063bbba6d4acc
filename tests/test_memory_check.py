"""The memory check before launch (``lightning_par/run/memory_check.py``): a run the estimator predicts cannot fit
stops in one line, before any process starts, with the predicted and available figures and the
advisor's plan for the machine; ``check_memory=false`` runs it anyway; a run that fits is not
stopped; a rank the kernel kills is reported as such (``describe_exit``)."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from lightning_par import ConfigError
from lightning_par.run.memory_check import available_per_rank, check_memory, predicted_peak, prediction
from lightning_par.strategies.launcher import describe_exit
from tests.helpers import composed, run_cli


def _built(tmp: Path, *overrides: str):
    from lightning_par.run.train import build

    cfg = composed(*overrides, tmp=tmp)
    parts = build(cfg)
    return cfg, parts["strategy"], parts["model"]


def test_a_model_that_cannot_fit_stops_in_one_line_before_launch(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = run_cli(["model=moe_64x_top8"], tmp_path / "run", check=False)
    took = time.monotonic() - start
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    need, have = (float(x) for x in re.search(r"need ([\d.]+) GiB per rank.*has ([\d.]+) GiB", lines[0]).groups())
    assert need > have and "lightning-par strategy=" in lines[0] and "check_memory=false" in lines[0], lines[0]
    assert took < 30, took  # the bound: it used to be killed by the kernel after about 90 s
    assert not (tmp_path / "run" / "summary.json").exists()


def test_the_check_can_be_skipped_and_passes_what_fits(tmp_path: Path) -> None:
    cfg, strategy, model = _built(tmp_path, "model=moe_64x_top8")
    peak, name = predicted_peak(cfg, strategy, model, 1)
    have, _ = available_per_rank(False, 1)
    assert name == "single" and peak > have  # the same prediction mode=estimate prints for it
    with pytest.raises(ConfigError, match="check_memory=false"):
        check_memory(cfg, strategy, model, 1)
    cfg.check_memory = False
    check_memory(cfg, strategy, model, 1)  # skipped
    cfg, strategy, model = _built(tmp_path, "experiment=quick", "strategy=zero3", "trainer.devices=2")
    peak, name = predicted_peak(cfg, strategy, model, 2)
    assert name == "zero3" and 0 < peak < available_per_rank(False, 2)[0]
    check_memory(cfg, strategy, model, 2)  # fits: not stopped
    cfg, strategy, model = _built(tmp_path, "model=hf_causal_lm")  # traced on fake tensors (costs/traced.py)
    peak, name = predicted_peak(cfg, strategy, model, 1)
    assert name == "single" and 0 < peak < available_per_rank(False, 1)[0]
    cfg, strategy, model = _built(tmp_path, "model=hf_causal_lm", "strategy=tensor_parallel", "trainer.devices=2")
    assert predicted_peak(cfg, strategy, model, 2) is None  # tp splits what a trace measures: not checked


def test_a_hugging_face_model_that_cannot_fit_stops_in_one_line(tmp_path: Path) -> None:
    """A model the estimator has no shape for used to go unchecked; its step is traced on fake tensors:
    a Llama of 1.3B parameters (a 256K vocabulary) under ddp on 2 ranks needs about 20 GiB each."""
    proc = run_cli(["model=hf_causal_lm", "model.hidden=2048", "model.layers=4", "model.heads=16",
                    "model.intermediate=8192", "model.vocab=256000", "strategy=ddp", "trainer.devices=2",
                    "data.seq_len=64"], tmp_path / "run", check=False)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    need, have = (float(x) for x in re.search(r"need ([\d.]+) GiB per rank.*has ([\d.]+) GiB", lines[0]).groups())
    assert need > have and 15 < need < 30 and "check_memory=false" in lines[0], lines[0]


def test_a_hugging_face_model_with_adamw8bit_is_checked(tmp_path: Path) -> None:
    """The check traces the step as mode=estimate does: with adamw8bit, torchao's compiled step ran on
    fake tensors and segfaulted the launching process (issue 34). It is now traced (``predicted_peak``
    gives None for a model the tracer cannot run) and, with 8-bit states, predicted below adamw's."""
    peaks = {}
    for name in ("adamw8bit", "adamw"):
        cfg, strategy, model = _built(tmp_path / name, "model=hf_causal_lm", f"model.optimizer={name}",
                                      "trainer.accelerator=cpu")
        predicted = predicted_peak(cfg, strategy, model, 1)
        assert predicted is not None and predicted[1] == "single", (name, predicted)
        peaks[name] = predicted[0]
        check_memory(cfg, strategy, model, 1)  # fits: not stopped
    assert 0 < peaks["adamw8bit"] < peaks["adamw"] < available_per_rank(False, 1)[0], peaks


def test_a_rank_killed_by_the_kernel_is_said_so() -> None:
    for code in (-signal.SIGKILL, 137):
        assert describe_exit(code) == "killed (SIGKILL: out of memory, or sent by a person or a scheduler)"
    assert describe_exit(-signal.SIGTERM) == "killed by SIGTERM" and describe_exit(3) == "exit code 3"


CONF = Path(__file__).resolve().parents[1] / "lightning_par" / "conf"
#: traced on fake tensors for 7-11 s each; model=hf_causal_lm and hf_llama_tiny take the same path
SLOW_TO_TRACE = {"hf_llama_1b", "hf_qwen2_0p5b"}


@pytest.mark.parametrize("override", [f"experiment={p.stem}" for p in sorted((CONF / "experiment").glob("*.yaml"))]
                         + [f"model={p.stem}" for p in sorted((CONF / "model").glob("*.yaml"))
                            if p.stem not in SLOW_TO_TRACE])
def test_every_experiment_and_model_is_checked(tmp_path: Path, override: str, capsys) -> None:
    """Issue 35: experiment=mlp (and the CNN) went unchecked in silence: the trace gave the classifier its
    input as the loss's target. Every shipped experiment and model preset, as configured, gets a predicted
    peak (none skipped), and the check runs quietly when it fits."""
    cfg, strategy, model = _built(tmp_path, override)
    world = int(cfg.trainer.devices) if str(cfg.trainer.devices).isdigit() else 1
    predicted = predicted_peak(cfg, strategy, model, world)
    assert predicted is not None and predicted[0] > 0, (override, prediction(cfg, strategy, model, world))
    if predicted[0] < available_per_rank(False, world)[0]:
        check_memory(cfg, strategy, model, world)
        assert "memory check skipped" not in capsys.readouterr().out


def test_a_run_that_cannot_be_predicted_says_so_in_one_note(tmp_path: Path, capsys) -> None:
    """Where no peak can be predicted (the MLP split by tp: a model without a GPT shape is priced from a
    traced step under data-parallel strategies only), the run goes on and one line says why; with
    check_memory=false, nothing."""
    cfg, strategy, model = _built(tmp_path, "experiment=mlp", "strategy=tensor_parallel", "trainer.devices=2")
    assert predicted_peak(cfg, strategy, model, 2) is None
    check_memory(cfg, strategy, model, 2)  # not stopped
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["note: memory check skipped: strategy=tensor_parallel splits MLPModule (tp=2, pp=1, ep=1), and "
                     "a model without a GPT shape is priced from one traced step under data-parallel strategies "
                     "only"], lines
    cfg.check_memory = False
    check_memory(cfg, strategy, model, 2)
    assert capsys.readouterr().out == ""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_note_is_printed_once_per_run(tmp_path: Path) -> None:
    """In a real run of 2 ranks: the note once (where the run is launched, not per rank), and the run trains."""
    proc = run_cli(["experiment=mlp", "strategy=tensor_parallel", "trainer.devices=2", "trainer.max_steps=2",
                    "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false"], tmp_path / "run")
    notes = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "memory check skipped" in ln]
    assert len(notes) == 1 and notes[0].startswith("note: memory check skipped: strategy=tensor_parallel"), notes
    assert (tmp_path / "run" / "summary.json").exists()
