"""Every yaml of every config group composes and instantiates on its own (not only the default), from the
package the app reads them from (``pkg://lightning_par.conf``); the config-name pre-check sees user config
directories (``hydra.searchpath``, ``--config-dir``) as Hydra does."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

from lightning_par.models.build import instantiate_model
from lightning_par import ConfigError
from lightning_par.cli import check_group_choices
from lightning_par.strategies.base import ParStrategyMixin
from tests.helpers import composed, run_cli
from tests.test_hf_dataset import tiny_dataset_and_tokenizer
from tests.test_tokens import write_tokens

CONF = Path(__file__).resolve().parents[1] / "lightning_par" / "conf"


def names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


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
        model = instantiate_model(cfg.model)
        model.configure_model()  # the architecture is built in Lightning's hook (meta here, as in the strategies)
    assert isinstance(model, L.LightningModule)
    plan = model.parallel_plan()
    for path in plan.layers + plan.blocks:
        model.get_submodule(path)  # every declared path exists


def _with_local_inputs(cfg, name, tmp_path):
    """``cfg.data`` given the files a data config leaves to the user (made here, offline)."""
    with open_dict(cfg):
        if "max_bytes" in cfg.data:
            cfg.data.max_bytes = 100_000
        if name == "hf_dataset":  # a saved dataset and a tokenizer of its own
            cfg.data.path, cfg.data.tokenizer = tiny_dataset_and_tokenizer(tmp_path)
            cfg.data.field, cfg.data.seq_len = "body", 16
        elif OmegaConf.is_missing(cfg.data, "path"):  # data=tokens: a small token file of its own
            write_tokens(tmp_path / "t.bin", np.arange(10_000, dtype=np.uint16))
            cfg.data.path = str(tmp_path / "t.bin")
    return cfg


@pytest.mark.parametrize("name", names("data"))
def test_data_yaml_instantiates(name, tmp_path):
    dm = instantiate(_with_local_inputs(composed(f"data={name}"), name, tmp_path).data)
    dm.setup("fit")
    x, y = dm.train_set[0]
    assert len(dm.train_set) > 0 and len(dm.val_set) > 0 and x.shape[0] > 0


@pytest.mark.parametrize("data", ["text", "synthetic", "tokens"])
def test_the_quick_preset_takes_any_token_data(data, tmp_path):
    """The preset sets only keys every token data module takes: ``experiment=quick data=tokens`` once
    failed on quick's ``data.max_bytes``, which only the text module has."""
    cfg = composed("experiment=quick", f"data={data}", tmp=tmp_path)
    dm = instantiate(_with_local_inputs(cfg, data, tmp_path).data)
    dm.setup("fit")
    assert len(dm.train_set) > 0 and cfg.data.seq_len == 64 and cfg.data.global_batch_size == 8


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
    from lightning_par.run.loggers import build_loggers  # each logger config sits under logger.<name>

    cfg = composed(f"logger={name}", tmp=tmp_path)
    (logger,) = build_loggers(cfg.logger)
    assert isinstance(logger, L.pytorch.loggers.Logger)


@pytest.mark.parametrize("name", names("experiment"))
def test_experiment_yaml_composes(name, tmp_path):
    cfg = composed(f"experiment={name}", tmp=tmp_path)
    instantiate(cfg.strategy)
    with torch.device("meta"):
        instantiate_model(cfg.model)
    instantiate(cfg.data)


def test_default_composition_is_the_documented_one():
    cfg = composed()
    assert HydraConfig.get().runtime.choices["strategy"] == "single"
    assert cfg.model.preset == "gpt_small" and cfg.data.files == "stdlib" and cfg.mode == "train"


# ---------------------------------------------------------------------------------------------------
# the config-name pre-check (lightning_par.cli.check_group_choices) and user config directories

USER_LOGGER = "_target_: lightning.pytorch.loggers.CSVLogger\nsave_dir: ${paths.output_dir}\nname: mine\n"


@pytest.fixture
def user_conf(tmp_path):
    """A user's config directory holding one more logger, ``logger=mine``."""
    d = tmp_path / "my_conf"
    (d / "logger").mkdir(parents=True)
    (d / "logger" / "mine.yaml").write_text(USER_LOGGER)
    return d


def refusal(argv: list[str]) -> str | None:
    try:
        check_group_choices(argv)
    except ConfigError as e:
        return str(e)
    return None


def test_precheck_accepts_configs_from_user_directories(user_conf, tmp_path, monkeypatch):
    assert refusal(["logger=mine"]) == "unknown logger 'mine'; choose from: " + ", ".join(names("logger"))
    assert refusal([f"hydra.searchpath=[file://{user_conf}]", "logger=mine"]) is None
    assert refusal(["--config-dir", str(user_conf), "logger=mine"]) is None
    assert refusal(["-m", f"hydra.searchpath=[file://{user_conf}]", "logger=csv,mine"]) is None
    # a package of configs: pkg://
    pkg = tmp_path / "site" / "my_lp_conf"
    (pkg / "logger").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "logger" / "mine.yaml").write_text(USER_LOGGER)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert refusal(["hydra.searchpath=[pkg://my_lp_conf]", "logger=mine"]) is None


def test_precheck_lists_choices_from_every_search_path(user_conf):
    msg = refusal([f"hydra.searchpath=[file://{user_conf}]", "logger=mnie"])
    assert msg == "unknown logger 'mnie'; choose from: " + ", ".join(sorted([*names("logger"), "mine"]))
    msg = refusal(["-m", "strategy=ddp,zer3"])
    assert msg == "unknown strategy 'zer3'; choose from: " + ", ".join(names("strategy"))
    assert "unknown strategy 'zer3'" in refusal(["strategy=choice(ddp,zer3)"])
    # nested groups too: Hydra's launchers, ours and the submitit plugin's
    msg = refusal(["hydra/launcher=slrum"])
    assert msg.startswith("unknown hydra/launcher 'slrum'; choose from: ") and "slurm" in msg and "basic" in msg


def test_precheck_leaves_fields_and_hydra_syntax_alone():
    for argv in (["trainer.devices=2", "hydra.run.dir=/tmp/x", "seed=3"], ["strategy=null"], ["+logger=csv"],
                 ["strategy=ddp", "data.files='~/my/*.txt'"], ["--help"], ["strategy=[unclosed"]):
        assert refusal(argv) is None, argv


def test_app_composes_a_user_config(user_conf, tmp_path):
    """The real command line: the user's logger is found and composed; a typo is one line listing it."""
    proc = run_cli(["--cfg", "job", f"hydra.searchpath=[file://{user_conf}]", "logger=mine"], tmp_path, timeout=60)
    assert "name: mine" in proc.stdout and "CSVLogger" in proc.stdout, proc.stdout
    proc = run_cli([f"hydra.searchpath=[file://{user_conf}]", "logger=mien"], tmp_path, timeout=60, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: unknown logger 'mien'; choose from: " + ", ".join(sorted([*names("logger"), "mine"]))], proc.stderr
