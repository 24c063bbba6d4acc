"""Every yaml of every config group composes and instantiates on its own (not only the default)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import open_dict

from lightning_par.strategies.base import ParStrategyMixin

CONF = Path(__file__).resolve().parents[1] / "lightning_par" / "conf"


def names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def composed(*overrides: str, tmp: Path | None = None):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # so ${hydra:...} resolves as in a real run
    if tmp is not None:
        with open_dict(cfg):
            cfg.paths.output_dir = str(tmp)
    return cfg


def test_groups_are_not_empty():
    for group in ("strategy", "model", "data", "trainer", "callbacks", "logger", "experiment"):
        assert names(group), group


@pytest.mark.parametrize("name", names("strategy"))
def test_strategy_yaml_instantiates_alone(name):
    cfg = composed(f"strategy={name}")
    strategy = instantiate(cfg.strategy)
    assert isinstance(strategy, L.pytorch.strategies.Strategy) and isinstance(strategy, ParStrategyMixin)


@pytest.mark.parametrize("name", names("model"))
def test_model_yaml_instantiates(name):
    cfg = composed(f"model={name}")
    with torch.device("meta"):  # the 7B preset would need 27 GB for real
        model = instantiate(cfg.model)
    assert isinstance(model, L.LightningModule)
    plan = model.parallel_plan()
    for path in plan.layers + plan.blocks:
        model.get_submodule(path)  # every declared path exists


@pytest.mark.parametrize("name", names("data"))
def test_data_yaml_instantiates(name):
    cfg = composed(f"data={name}")
    with open_dict(cfg):
        if "max_bytes" in cfg.data:
            cfg.data.max_bytes = 100_000
    dm = instantiate(cfg.data)
    dm.setup("fit")
    x, y = dm.train_set[0]
    assert len(dm.train_set) > 0 and len(dm.val_set) > 0 and x.shape[0] > 0


@pytest.mark.parametrize("name", names("trainer"))
def test_trainer_yaml_instantiates(name, tmp_path):
    cfg = composed(f"trainer={name}", tmp=tmp_path)
    trainer = instantiate(cfg.trainer, logger=False)
    assert isinstance(trainer, L.Trainer)


@pytest.mark.parametrize("name", names("callbacks"))
def test_callbacks_yaml_instantiates(name, tmp_path):
    cfg = composed(f"callbacks={name}", tmp=tmp_path)
    for node in (cfg.callbacks or {}).values():
        assert isinstance(instantiate(node), L.Callback)


@pytest.mark.parametrize("name", names("logger"))
def test_logger_yaml_instantiates(name, tmp_path):
    cfg = composed(f"logger={name}", tmp=tmp_path)
    logger = instantiate(cfg.logger)
    assert logger is None or isinstance(logger, L.pytorch.loggers.Logger)


@pytest.mark.parametrize("name", names("experiment"))
def test_experiment_yaml_composes(name, tmp_path):
    cfg = composed(f"experiment={name}", tmp=tmp_path)
    instantiate(cfg.strategy)
    with torch.device("meta"):
        instantiate(cfg.model)
    instantiate(cfg.data)


def test_default_composition_is_the_documented_one():
    cfg = composed()
    assert HydraConfig.get().runtime.choices["strategy"] == "single"
    assert cfg.model.preset == "gpt_small" and cfg.data.files == "stdlib" and cfg.mode == "train"
