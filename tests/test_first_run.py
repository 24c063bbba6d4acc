"""A newcomer's first runs (issue 22, part 7): what the README's tables suggest runs as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import train_summary


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cnn_on_images_runs(tmp_path: Path) -> None:
    """``model=cnn data=images`` (the README's table) stopped in Lightning's check that
    ``val_check_interval`` (100) fits in one epoch (57 batches): validation now counts the whole run's
    batches (``check_val_every_n_epoch: null``), so a short epoch is no error."""
    s = train_summary(["model=cnn", "data=images", "trainer.max_steps=3", "trainer.enable_progress_bar=false"],
                      tmp_path)
    assert s["steps"] == 3 and s["final_loss"] is not None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_progress_bar_log_lines_and_run_directory(tmp_path: Path) -> None:
    """The bar read "Epoch 0/-2" (Lightning prints max_epochs - 1, and the app trains by max_steps with
    max_epochs=-1); every Lightning INFO line came twice (its own handler and Hydra's); the run directory
    was never printed. Now "Epoch 0", each line once, and a last line naming the directory."""
    from tests.helpers import QUICK, run_cli

    proc = run_cli([*[a for a in QUICK if "progress_bar" not in a], "trainer.max_steps=3"], tmp_path / "run")
    out = proc.stdout + proc.stderr
    assert "Epoch 0" in out and "/-2" not in out, out[-2000:]
    # Lightning's INFO lines once (through Hydra's handlers: console and run.log), and no pytree warning
    assert out.count("GPU available") == 1 and "GPU available" in (tmp_path / "run" / "run.log").read_text(), out
    assert "LeafSpec" not in out, out
    assert f"run directory: {tmp_path / 'run'}" in proc.stdout.strip().splitlines()[-1], proc.stdout[-1000:]


@pytest.mark.parametrize("argv,message", [
    (["trainer.max_stpes=2"], "unknown key trainer.max_stpes; did you mean trainer.max_steps?"),
    (["experiment=quick", "model.lrr=0.1"], "unknown key model.lrr; did you mean model.lr?"),
    (["trainr.devices=2"], "unknown key trainr.devices; did you mean trainer?"),
    (["-m", "strategy=ddp,zero1", "trainer.devicse=2"], "did you mean trainer.devices?"),
    (["strategy=zero3", "strategy.reshard_after_forward=false"], "strategy has: _target_, activation_checkpointing"),
])
def test_a_field_typo_names_the_closest_key(argv, message) -> None:
    """Hydra answered a typo with "To append to your config use +trainer.max_stpes=2" (which adds the
    typo as a new key and runs on); now one line with the closest existing name."""
    from lightning_par import ConfigError
    from lightning_par.cli import check_field_names

    with pytest.raises(ConfigError, match=message.replace("?", r"\?")) as e:
        check_field_names(argv)
    assert "\n" not in str(e.value)


def test_fields_that_exist_pass() -> None:
    from lightning_par.cli import check_field_names

    for argv in (["experiment=quick", "trainer.max_steps=2", "model.lr=0.01", "data.seq_len=32"],
                 ["strategy=fsdp", "strategy.prefetch=2", "+strategy.tiling={net.head.lm_head:2}"],
                 ["callbacks=checkpoint", "callbacks.checkpoint.every_n_train_steps=5"],
                 ["paths.output_dir=/tmp/x"],  # an interpolated default (${hydra:...}): not resolved to check it
                 ["-m", "strategy=fsdp,zero3", "trainer.devices=2", "hydra.sweep.dir=/tmp/x"]):
        check_field_names(argv)
