"""Loggers: several at once (``logger=[csv,tensorboard,wandb,mlflow]``), each writing into the run
directory without a network, each holding the run's resolved config as hyper-parameters."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger
from omegaconf import OmegaConf

from lightning_par import ConfigError
from lightning_par.run.loggers import WandbLogger, build_loggers, run_config
from tests.helpers import QUICK, composed, run_cli

ALL = "logger=[csv,tensorboard,wandb,mlflow]"


def test_one_or_several_loggers_from_the_group(tmp_path):
    assert list(composed(tmp=tmp_path).logger) == ["csv"]  # the default
    assert list(composed("logger=tensorboard", tmp=tmp_path).logger) == ["tensorboard"]
    cfg = composed(ALL, tmp=tmp_path)
    assert list(cfg.logger) == ["csv", "tensorboard", "wandb", "mlflow"]
    loggers = build_loggers(cfg.logger)
    assert [type(lg) for lg in loggers] == [CSVLogger, TensorBoardLogger, WandbLogger, MLFlowLogger]
    assert loggers[2]._offline and loggers[3]._tracking_uri == f"file:{tmp_path}/mlruns"
    assert build_loggers(composed("~logger", tmp=tmp_path).get("logger")) is False


def test_a_single_user_logger_config_and_a_broken_one():
    (lg,) = build_loggers(OmegaConf.create({"_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": "x"}))
    assert isinstance(lg, CSVLogger)
    with pytest.raises(ConfigError, match=r"logger.mine has no _target_; .*'# @package logger.<its name>'"):
        build_loggers(OmegaConf.create({"csv": {"_target_": "lightning.pytorch.loggers.CSVLogger"},
                                        "mine": {"save_dir": "x"}}))
    with pytest.raises(ConfigError, match="logger csv: TypeError"):
        build_loggers(OmegaConf.create({"csv": {"_target_": "lightning.pytorch.loggers.CSVLogger", "nope": 1}}))


def test_run_config_holds_choices_mesh_and_the_resolved_config(tmp_path):
    from hydra.utils import instantiate

    cfg = composed("strategy=fsdp_tp", "trainer.devices=4", "strategy.tp=2", tmp=tmp_path)
    params = run_config(cfg, instantiate(cfg.strategy))
    assert params["choices"]["strategy"] == "fsdp_tp" and params["trainer"]["devices"] == 4
    assert params["world_size"] == 4 and params["mesh"] == {"dp_shard": 2, "tp": 2}
    assert params["paths"]["output_dir"] == str(tmp_path)  # resolved, not ${...}
    json.dumps(params)  # plain Python only


# ------------------------------------------------------------------------------ one real run
def _wandb_records(path: Path):
    """The records of a W&B offline run file (``run-*.wandb``): W&B's block log (7-byte header, 32 KiB
    blocks of chunks: crc 4, length 2 little-endian, type 1 -- full/first/middle/last), each record a
    protobuf ``Record`` (read with wandb's own schema). W&B has no public reader for offline runs and
    writes ``files/config.yaml`` only when a run is synced."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.fixture(scope="module")
def all_four(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("loggers")
    run_cli([*QUICK, "trainer.max_steps=6", "strategy=ddp", "trainer.devices=2", ALL], run_dir, timeout=300)
    return run_dir


def _assert_run_config(params: dict) -> None:
    assert params["choices"]["strategy"] == "ddp", params.get("choices")
    assert params["strategy"]["_target_"] == "lightning_par.strategies.DDPStrategy"
    assert params["trainer"]["devices"] == 2 and params["mesh"] == {"dp_replicate": 2}
    assert params["model"]["preset"] == "gpt_tiny" and params["data"]["global_batch_size"] == 8


@pytest.mark.slow
def test_csv_and_tensorboard_write_metrics_and_the_run_config(all_four):
    with open(all_four / "csv" / "metrics.csv") as f:
        assert [r["train/loss"] for r in csv.DictReader(f) if r.get("train/loss")]
    for name in ("csv", "tensorboard"):
        _assert_run_config(yaml.safe_load((all_four / name / "hparams.yaml").read_text()))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (all_four / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    assert "train/loss" in acc.Tags()["scalars"]


@pytest.mark.slow
def test_mlflow_writes_a_local_run_with_flat_params(all_four, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{all_four}/mlruns")
    (run,) = client.search_runs([client.get_experiment_by_name("lightning_par").experiment_id])
    params = run.data.params
    assert params["choices/strategy"] == "ddp" and params["trainer/devices"] == "2"
    assert params["strategy/_target_"] == "lightning_par.strategies.DDPStrategy"
    assert "train/loss" in run.data.metrics and run.info.status == "FINISHED"


@pytest.mark.slow
def test_wandb_writes_an_offline_run_with_the_config(all_four):
    (run_file,) = (all_four / "wandb").glob("offline-run-*/run-*.wandb")  # one run, written by rank 0 only
    config, history_keys, exit_code = {}, set(), None
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            history_keys.update(item.key or "/".join(item.nested_key) for item in record.history.item)
        elif kind == "exit":
            exit_code = record.exit.exit_code
    _assert_run_config(config)
    assert "train/loss" in history_keys
    assert exit_code == 0  # the run was finished with the job (lightning_par.run.loggers.WandbLogger)
