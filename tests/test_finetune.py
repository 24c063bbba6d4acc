"""A fine-tune's defaults (issue 34): ``model.pretrained=DIR`` gets fine-tuning hyper-parameters and
checkpoints, each overridable as any other value; an export of a checkpoint that is not there says how
to get one.

In-process and quick: the config composed as the app composes it, the run's parts built as ``train.build``
builds them (no process started). End to end -- the README's fine-tune section run as written, its LR
schedule read back from the run's metrics -- in ``tests/test_recipes.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from lightning_par import ConfigError
from lightning_par.core.optim import OptimizerConfig, ScheduleConfig, build_optimizer, build_scheduler
from tests.helpers import composed

HF = "model=hf_causal_lm"


def _resolved(*overrides: str) -> dict:
    cfg = composed(*overrides)
    # resolved: what the child ranks and the loggers see
    return {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "scheduler")}


@pytest.mark.parametrize("overrides,lr,schedule", [
    # from scratch: as before (3e-3, constant)
    ((HF,), 3e-3, ("constant", 0, 0.0)),
    # a fine-tune: transformers' Trainer's lr, linear warm-up over 10% of the steps, then linear decay to 0
    ((HF, "model.pretrained=some/dir"), 5e-5, ("warmup_linear", 0, 0.1)),
    # what is given wins
    ((HF, "model.pretrained=some/dir", "model.lr=2e-4"), 2e-4, ("warmup_linear", 0, 0.1)),
    ((HF, "model.pretrained=some/dir", "scheduler=constant"), 5e-5, ("constant", 0, 0.0)),
    ((HF, "model.pretrained=some/dir", "scheduler=warmup_cosine"), 5e-5, ("warmup_cosine", 30, 0.0)),
    ((HF, "model.pretrained=some/dir", "scheduler.warmup_steps=7"), 5e-5, ("warmup_linear", 7, 0.1)),
    ((HF, "model.pretrained=some/dir", "scheduler.name=warmup_cosine"), 5e-5, ("warmup_cosine", 0, 0.1)),
    # a preset built on hf_causal_lm inherits the rule; a model without model.pretrained is untouched
    (("model=hf_llama_tiny", "model.pretrained=some/dir"), 5e-5, ("warmup_linear", 0, 0.1)),
    (("model=gpt_tiny",), 3e-3, ("constant", 0, 0.0)),
], ids=["scratch", "finetune", "lr-given", "constant-chosen", "cosine-chosen", "warmup-given", "name-given",
        "preset", "gpt"])
def test_fine_tuning_defaults_and_overrides(overrides, lr, schedule) -> None:
    cfg = _resolved(*overrides)
    assert cfg["model"]["lr"] == pytest.approx(lr)
    s = cfg["scheduler"]
    assert (s["name"], s["warmup_steps"], s["warmup_ratio"]) == schedule


def test_the_warmup_ratio_is_a_share_of_the_steps() -> None:
    def lrs(schedule: ScheduleConfig, total: int) -> list[float]:
        opt = build_optimizer(nn.Linear(2, 2).parameters(), OptimizerConfig(lr=1.0))
        sched = build_scheduler(opt, schedule, total_steps=total)
        out = []
        for _ in range(total):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    finetune = ScheduleConfig("warmup_linear", warmup_ratio=0.1)
    got = lrs(finetune, 50)
    assert got[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])  # ceil(0.1 x 50) = 5 warm-up steps
    assert all(a > b for a, b in zip(got[5:], got[6:])) and got[-1] < 0.05  # then linear decay towards 0
    # a short run is not refused ("total_steps must exceed warmup_steps"): the warm-up is at most total - 1 steps
    assert lrs(finetune, 2) == pytest.approx([1.0, 1.0]) and lrs(finetune, 1) == pytest.approx([1.0])
    assert lrs(ScheduleConfig("warmup_linear", warmup_steps=3, warmup_ratio=0.5), 10)[:3] == \
        pytest.approx([1 / 3, 2 / 3, 1.0])  # warmup_steps wins over the ratio
    with pytest.raises(ConfigError, match="warmup_ratio=1.5 must be in"):
        ScheduleConfig("warmup_linear", warmup_ratio=1.5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from lightning_par.tools.tiny_checkpoint import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.mark.parametrize("overrides,written", [
    ((), False),                                              # from scratch: no checkpoints, as before
    (("callbacks=checkpoint",), True),                        # ... unless asked
    (("FINETUNE",), True),                                    # a fine-tune: checkpoints by default
    (("FINETUNE", "trainer.enable_checkpointing=false"), False),  # ... unless turned off
    (("FINETUNE", "callbacks=none"), False),                  # no callbacks at all
], ids=["scratch", "scratch-asked", "finetune", "finetune-off", "finetune-none"])
def test_a_fine_tune_writes_checkpoints_by_default(tiny: Path, tmp_path: Path, overrides, written) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_par.callbacks.checkpoint import RunCheckpoint
    from lightning_par.run.train import build

    args = [f"model.pretrained={tiny}" if o == "FINETUNE" else o for o in overrides]
    cfg = composed(HF, "data.seq_len=32", *args, tmp=tmp_path)
    parts = build(cfg)
    checkpoints = [cb for cb in parts["callbacks"] if isinstance(cb, ModelCheckpoint)]
    assert parts["enable_checkpointing"] is written
    if written:
        (cb,) = checkpoints
        assert isinstance(cb, RunCheckpoint) and cb.at_end and cb.dirpath == str(tmp_path / "checkpoints")
        assert cb._every_n_train_steps == 100 and cb.save_top_k == -1
    else:
        assert checkpoints == []
    if "FINETUNE" in overrides:  # and its optimizer settings reached the model
        model = parts["model"]
        assert model.lr == pytest.approx(5e-5) and model.schedule == ScheduleConfig("warmup_linear", warmup_ratio=0.1)


def test_the_last_step_is_checkpointed_once(tmp_path: Path) -> None:
    """``at_end``: a checkpoint at the last step, unless that step's was written already (a multiple of
    every_n_train_steps). A plain Trainer on one CPU process (Lightning's own single-file checkpoints)."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_par.callbacks.checkpoint import RunCheckpoint

    def names(every: int, steps: int) -> list[str]:
        out = tmp_path / f"every{every}-steps{steps}"
        cb = RunCheckpoint(dirpath=str(out), filename="step{step:06d}", auto_insert_metric_name=False,
                           every_n_train_steps=every, save_top_k=-1)
        L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[cb], logger=False, limit_val_batches=0,
                  enable_progress_bar=False, enable_model_summary=False).fit(BoringModel())
        return sorted(p.name for p in out.iterdir())

    assert names(4, 10) == ["step000004.ckpt", "step000008.ckpt", "step000010.ckpt"]  # the last step too
    assert names(5, 10) == ["step000005.ckpt", "step000010.ckpt"]  # once (no step000010-v1.ckpt)


def test_exporting_a_checkpoint_that_is_not_there_says_how_to_get_one(tmp_path: Path) -> None:
    from lightning_par.strategies.checkpoint.export import export

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ConfigError) as info:
        export(run / "checkpoints" / "step000100.ckpt", tmp_path / "out")
    line = str(info.value)
    assert "checkpoints/step000100.ckpt does not exist" in line and "holds no checkpoint" in line, line
    assert "model.pretrained=DIR" in line and "callbacks=checkpoint" in line and "callbacks.export.at_end=true" in line
    (run / "checkpoints" / "step000050.ckpt").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"step000100.ckpt does not exist; .*checkpoints holds step000050.ckpt$"):
        export(run / "checkpoints" / "step000100.ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_measured_model_name_is_the_users_class() -> None:
    """FSDP2 swaps a module's class for a dynamic ``FSDP<Name>`` subclass; messages name the user's class."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_par.callbacks.throughput import class_name

    class MyLM(nn.Module):
        pass

    wrapped = MyLM()
    wrapped.__class__ = type("FSDPMyLM", (FSDPModule, MyLM), {})
    assert type(wrapped).__name__ == "FSDPMyLM" and class_name(wrapped) == "MyLM"
    assert class_name(MyLM()) == "MyLM" and class_name(torch.zeros(1)) == "Tensor"
