"""Where config meets code: ``train(cfg)`` validates, instantiates and fits; nothing below it sees
a config node.

Order: validate everything that can be checked without processes (names, sizes, precision,
devices, model/data match, the strategy's own constraints) and raise ``ConfigError`` with one line;
then build data, model, strategy, callbacks, logger and trainer; then fit. The run claims its run
directory (``jobs.claim_run_dir``; the app claims it before Hydra writes there: a second live run
into it is refused) and checks that the
output and checkpoint directories are writable. For multi-process runs started here (not by
torchrun or Slurm), the resolved config is written next to the run's Hydra files, one file per run,
and ranks 1..N-1 start as ``python -m lightning_par.run.child <that file>`` would (for a CPU job forked
from a server that imported it, ``core/fork_ranks.py``) -- which is why Hydra multirun works
(see ``strategies/launcher.py``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.fabric.connector import _PRECISION_INPUT_STR
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from omegaconf import DictConfig, OmegaConf

from lightning_par import ConfigError
from lightning_par.run import facts
from lightning_par.callbacks.guard import RunGuard, RunStopped
from lightning_par.callbacks.progress import progress_bar
from lightning_par.run.memory_check import check_memory
from lightning_par.data.datamodules import ParDataModule
from lightning_par.core.jobs import claim_run_dir, clear_failure, global_rank
from lightning_par.parallel.contract import input_kind_of
from lightning_par.parallel.elastic import init_elastic_process_group
from lightning_par.strategies.checkpoint.dcp import check_checkpoint
from lightning_par.core.fork_ranks import CHILD_MODULE, ChildEntry

PRECISIONS = tuple(p for p in typing.get_args(_PRECISION_INPUT_STR) if not p.startswith("transformer"))
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK",
             "OMP_NUM_THREADS", "PL_GLOBAL_SEED")


def _accelerator(cfg: DictConfig) -> str:
    return facts.accelerator(cfg.trainer)


def torchrun_world() -> tuple[int, int] | None:
    """(processes per node, nodes) under torchrun, else None (``lightning_par.run.facts``)."""
    return facts.torchrun_world()


def world_size_of(cfg: DictConfig) -> int:
    """The run's world size: one rule for training, ``mode=estimate`` and the advisor (``run/facts.py``)."""
    return facts.world_size(cfg)


def launched_externally() -> bool:
    """True under torchrun or srun: the cluster, not Lightning, starts the processes."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    return TorchElasticEnvironment.detect() or SLURMEnvironment.detect()


def validate(cfg: DictConfig, strategy: Any, model: L.LightningModule, datamodule: Any) -> int:
    """Check everything checkable before processes start; returns the world size."""
    precision = str(cfg.trainer.get("precision", "32-true"))
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; choose from: {', '.join(PRECISIONS)}")
    acc = _accelerator(cfg)
    if acc == "gpu":
        raise ConfigError("trainer.accelerator=gpu but no GPU is visible; use trainer.accelerator=cpu or auto")
    if acc == "cpu" and precision.startswith("16"):
        raise ConfigError(f"precision {precision} needs a GPU; on CPU use bf16-mixed, bf16-true or 32-true")
    from lightning_par.run.attention_option import check_attention

    check_attention(model, acc, precision)  # the attention backend against the device (run/attention_option.py)
    world = world_size_of(cfg)
    devices = world // int(cfg.trainer.get("num_nodes", 1))
    if getattr(strategy, "single_process", False) and world > 1:
        print(f"note: strategy {cfg.strategy._target_.rsplit('.', 1)[-1]} runs one process; trainer.devices={devices} is ignored")
        world = 1
    if acc == "cuda" and devices > torch.cuda.device_count():
        raise ConfigError(f"trainer.devices={devices} but this machine has {torch.cuda.device_count()} GPU(s)")
    model_kind, data_kind = input_kind_of(model), input_kind_of(datamodule)
    if model_kind and data_kind and model_kind != data_kind:
        raise ConfigError(f"model {type(model).__name__} takes {model_kind} but data {type(datamodule).__name__} "
                          f"gives {data_kind}; pick a matching data= (or use an experiment= preset)")
    check_vocabulary(model, datamodule)
    check_splits = getattr(datamodule, "check_splits", None)  # a split that cannot fill one global batch
    if callable(check_splits):
        check_splits(validates(cfg))
    validate_strategy = getattr(strategy, "validate_setup", None)
    if callable(validate_strategy):
        try:
            validate_strategy(world, model)
            # trainer.sync_batchnorm reaches the strategy only from the Trainer, built after launch: ask now
            if bool(cfg.trainer.get("sync_batchnorm", False)) and hasattr(strategy, "check_sync_batchnorm"):
                strategy.check_sync_batchnorm(world, model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        dims = strategy.dims_for(world)
        declared = getattr(datamodule, "global_batch_size", None)  # a user's DataModule may have none
        micro = facts.micro_batch_size(int(declared), dims.dp, int(cfg.trainer.get("accumulate_grad_batches", 1))) \
            if declared else None
        check_batch = getattr(strategy, "validate_batch", None)  # e.g. pipelines: micro-batches must divide it
        if callable(check_batch) and micro is not None:
            try:
                check_batch(micro, world)
            except ValueError as e:
                raise ConfigError(str(e)) from None
    return world


@contextmanager
def _restored_process_env() -> Iterator[None]:
    """Undo what one training job changes in this process, so the next multirun job starts clean
    (a fresh port, its own thread count, no leftover process group)."""
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch.set_num_threads(threads)


def validates(cfg: DictConfig) -> bool:
    """Whether the run will run a validation pass (so needs its validation split): not with
    ``trainer.limit_val_batches=0``, nor when validation is every ``val_check_interval`` training batches
    counted over the run (``check_val_every_n_epoch: null``, the app's default) and the run is shorter;
    else (epoch-based, a fraction of an epoch, no step limit) it may: True."""
    t = cfg.trainer
    if t.get("limit_val_batches", 1.0) in (0, 0.0):
        return False
    interval, max_steps = t.get("val_check_interval", 1.0), t.get("max_steps", -1)
    if isinstance(interval, int) and t.get("check_val_every_n_epoch", 1) is None and isinstance(max_steps, int) \
            and max_steps > 0:
        return max_steps * int(t.get("accumulate_grad_batches", 1) or 1) >= interval
    return True


def check_vocabulary(model: Any, datamodule: Any) -> None:
    """One line when the data's token ids can exceed the model's vocabulary (a tokenizer larger than
    the model's embedding: the first such id would index past it mid-run)."""
    data_vocab = getattr(datamodule, "vocab_size", None)
    config = getattr(model, "hf_config", None) or getattr(model, "config", None)
    model_vocab = getattr(config, "vocab_size", None)
    if isinstance(data_vocab, int) and isinstance(model_vocab, int) and data_vocab > model_vocab:
        path = getattr(datamodule, "path", None)  # token files: name them (their header gives the vocabulary)
        source = getattr(datamodule, "tokenizer_dir", None) or (f"{type(datamodule).__name__} {path}" if path
                                                                 else type(datamodule).__name__)
        raise ConfigError(f"the data's vocabulary ({data_vocab} ids, {source}) is larger than the model's "
                          f"({model_vocab}): use the model's own tokenizer, or a model with vocab >= {data_vocab}")


def build(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate every part of a run from its config (no processes started). ``cfg`` is checked already:
    each value's type and range (``config_values.check_config_values``) once per launch, by the launching
    process (``cli._run``) before any rank starts -- not again here, nor in the child ranks."""
    try:
        from lightning_par.models.build import instantiate_model
        from lightning_par.run.float8_option import float8_of
        from lightning_par.run.tiling_option import pop_tiling, set_tiling

        strategy_cfg, tiling = pop_tiling(cfg.strategy)  # an option of every strategy (run/tiling_option.py)
        float8 = float8_of(cfg.model)  # applied by the strategy (run/float8_option.py)
        strategy = instantiate(strategy_cfg)
        model = instantiate_model(cfg.model)
        datamodule = instantiate(cfg.data)
        callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
        with torch.device("meta"):  # what the strategies will do too: shapes only, no memory
            model.configure_model()  # so the checks before launch see the architecture
    except Exception as e:  # hydra wraps constructor errors; show the cause in one line
        cause = e.__cause__ or e
        raise ConfigError(str(cause) if isinstance(cause, ConfigError) else f"{type(cause).__name__}: {cause}") from None
    set_compile(strategy, cfg.get("compile", False))
    from lightning_par.run.float8_option import set_float8

    set_float8(strategy, float8, facts.accelerator(cfg.trainer))
    from lightning_par.run.loggers import build_loggers, log_run_config

    logger = log_run_config(build_loggers(cfg.get("logger")), cfg, strategy)
    from lightning_par.core.optim import apply_schedule

    apply_schedule(model, cfg.get("scheduler"), cfg.data.get("global_batch_size"))  # LR schedule, scaling
    set_tiling(strategy, tiling, model)  # checked against the meta model, before any process starts
    from lightning_par.callbacks.checkpoint import checkpointing

    # trainer.enable_checkpointing null (the default): checkpoints for a fine-tune only (callbacks/checkpoint.py)
    callbacks, enable_checkpointing = checkpointing(
        callbacks, finetune=bool(OmegaConf.select(cfg, "model.pretrained", default=None)),
        setting=cfg.trainer.get("enable_checkpointing"))
    return dict(strategy=strategy, model=model, datamodule=datamodule, callbacks=callbacks, logger=logger,
                enable_checkpointing=enable_checkpointing)


def set_compile(strategy: Any, option: Any) -> None:
    """The top-level ``compile`` key onto the strategy (checked here, before any process starts)."""
    from lightning_par.strategies.base import ParStrategyMixin, compile_fields

    option = OmegaConf.to_container(option) if isinstance(option, DictConfig) else option
    if compile_fields(option)["compile"] and not isinstance(strategy, ParStrategyMixin):
        raise ConfigError(f"compile={option} needs a lightning_par strategy, not {type(strategy).__name__}")
    if isinstance(strategy, ParStrategyMixin):
        strategy.compile = option


def train(cfg: DictConfig, *, child: bool = False) -> dict[str, Any] | None:
    """Validate, instantiate and fit one run; returns the run summary on global rank 0. ``cfg``'s values
    were checked by the launch (``config_values.check_config_values``, in ``cli._run``; a program of its own
    calls it first): this runs only the checks that need the built objects (``validate``, and on the
    launching rank the memory, run-directory and checkpoint checks)."""
    L.seed_everything(int(cfg.seed), workers=True, verbose=False)  # same seed: same weights on every rank
    parts = build(cfg)
    strategy = parts["strategy"]
    world = validate(cfg, strategy, parts["model"], parts["datamodule"])
    if not child and global_rank() == 0:  # once, where the run is launched: ranks see each other's memory
        check_memory(cfg, strategy, parts["model"], world)  # the predicted peak against what a rank has
    if getattr(strategy, "single_process", False) and launched_externally() and global_rank() > 0:
        return None  # srun/torchrun started several tasks for a one-process strategy: rank 0 trains alone
    # lightning_par's data modules split the data along the strategy's data-parallel axis themselves;
    # a user's DataModule gets Lightning's distributed sampler (the strategy gives the dp rank and size),
    # never the same batches on every rank
    trainer_kwargs: dict[str, Any] = {"use_distributed_sampler": not isinstance(parts["datamodule"], ParDataModule),
                                      "enable_checkpointing": parts["enable_checkpointing"]}
    if world == 1:
        trainer_kwargs.update(devices=1, num_nodes=1)
    elif torchrun_world() is not None:
        trainer_kwargs.update(zip(("devices", "num_nodes"), torchrun_world()))
    out_dir = str(cfg.paths.output_dir)
    callbacks = with_guard(parts["callbacks"])
    ckpt_dirs = checkpoint_dirs(callbacks, out_dir)
    owner = not child and global_rank() == 0  # the process that holds the run directory
    # RunDirInUse (a ConfigError) when another live run holds the directory
    lock = claim_run_dir(out_dir) if owner else None
    try:
        if owner:
            check_writable(out_dir, "output")
            for d in ckpt_dirs:
                check_writable(d, "checkpoint")
            # a missing or damaged checkpoint is one line naming the file, before any rank starts
            check_checkpoint(resolve_ckpt_path(cfg.get("ckpt_path"), out_dir, ckpt_dirs))
        if world > 1 and not child and not launched_externally():
            config_path = _write_child_config(cfg, out_dir)
            entry = ChildEntry(CHILD_MODULE, (config_path,))
            # a CPU job's ranks fork from a preloaded server; a GPU job's start as commands (fork_ranks.py)
            strategy.child_command = entry if _accelerator(cfg) == "cpu" else entry.command()
            strategy.child_cwd = os.getcwd()
        with _restored_process_env():
            if world > 1:  # under torchrun: a fresh store namespace per restart (see parallel/elastic.py)
                init_elastic_process_group("nccl" if _accelerator(cfg) == "cuda" else "gloo")
            if cfg.trainer.get("enable_progress_bar", True) and not any(isinstance(c, ProgressBar) for c in callbacks):
                callbacks = [*callbacks, progress_bar()]  # "Epoch 0", not Lightning's "Epoch 0/-2"
            trainer = instantiate(cfg.trainer, strategy=strategy, callbacks=callbacks, logger=parts["logger"],
                                  **trainer_kwargs)
            ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), out_dir, ckpt_dirs)
            try:
                trainer.fit(parts["model"], datamodule=parts["datamodule"], ckpt_path=ckpt_path)
            except RunStopped as e:
                if trainer.is_global_zero:
                    print(f"stopped: {e}", file=sys.stderr, flush=True)
                raise
            summary = next((cb.summary for cb in trainer.callbacks if type(cb).__name__ == "RunSummary"), None)
        if trainer.is_global_zero:
            clear_failure(out_dir)  # e.g. left by a torchrun attempt that died before this one finished
            print(f"run directory: {out_dir}", flush=True)
    finally:
        if lock is not None:
            lock.release()
    return summary if trainer.is_global_zero else None


def with_guard(callbacks: list[Any]) -> list[Any]:
    """The callbacks, with a ``RunGuard`` (safe SIGTERM stop, non-finite loss check) appended when the
    config has none (e.g. ``callbacks=none``): without it Lightning's own SIGTERM handling would run,
    and that deadlocks multi-process runs (see callbacks/guard.py). The guard goes last: its stop
    checkpoint must see this step's loss already recorded by the summary callback."""
    guards = [cb for cb in callbacks if isinstance(cb, RunGuard)] or [RunGuard()]
    return [cb for cb in callbacks if not isinstance(cb, RunGuard)] + guards


def checkpoint_dirs(callbacks: list[Any], out_dir: str) -> list[str]:
    """Where this run's checkpoints go: each ``ModelCheckpoint``'s directory, else ``<run dir>/checkpoints``
    (the stop checkpoint's default)."""
    dirs = [str(cb.dirpath) for cb in callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    return dirs or [os.path.join(out_dir, "checkpoints")]


def check_writable(directory: str, what: str) -> None:
    """Fail in one line, before training, when ``directory`` cannot be created or written. Directories
    created only for the test are removed again (a run without checkpoints leaves no empty folder)."""
    created = []
    d = os.path.abspath(directory)
    while not os.path.exists(d) and os.path.dirname(d) != d:
        created.append(d)
        d = os.path.dirname(d)
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"{what} directory {directory} is not writable: {e.strerror or e}") from None
    finally:
        for c in created:
            try:
                os.rmdir(c)
            except OSError:
                break


def checkpoint_step(path: str) -> int | None:
    """The global step a checkpoint recorded, or None when it is incomplete or unreadable.

    A lightning_par checkpoint is a DCP directory, complete once ``.metadata`` exists (DCP writes it
    last); its step is in ``meta.pt`` (Lightning's ``global_step``), which holds no model tensors.
    A single-file checkpoint is memory-mapped, so its tensors are not read either."""
    try:
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, ".metadata")):
                return None
            meta = torch.load(os.path.join(path, _METADATA_FILENAME), map_location="cpu", weights_only=True)
        else:
            meta = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        return int(meta["global_step"])
    except Exception:  # noqa: BLE001 -- a damaged or foreign file is not a candidate
        return None


def latest_checkpoint(*directories: str) -> str | None:
    """The checkpoint with the highest recorded global step among ``directories`` (ties: the newest
    file), ignoring incomplete ones. Candidates: ``*.ckpt`` entries, including Lightning's Slurm
    ``hpc_ckpt_N.ckpt``. File names are not parsed (``step000016-v1.ckpt`` is step 16)."""
    found = []
    for directory in directories:
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if not name.endswith(".ckpt"):
                continue
            step = checkpoint_step(path)
            if step is not None:
                found.append((step, os.path.getmtime(path), path))
    return max(found)[2] if found else None


def resolve_ckpt_path(ckpt_path: str | None, out_dir: str, ckpt_dirs: list[str] | None = None) -> str | None:
    """``auto``: resume from this run's newest complete checkpoint (in its checkpoint directories or
    Slurm's ``hpc_ckpt_N.ckpt`` in the run directory), if any -- how a run restarted by torchrun,
    requeued by Slurm or stopped by SIGTERM picks up where it stopped; else the path as given."""
    if ckpt_path != "auto":
        return ckpt_path
    return latest_checkpoint(*(ckpt_dirs or [os.path.join(out_dir, "checkpoints")]), out_dir)


def _write_child_config(cfg: DictConfig, out_dir: str) -> str:
    """The fully resolved config, where the child ranks read it (next to Hydra's own files), under a
    name of its own per run (``resolved-<pid>-<random>.yaml``): a later run that shares the
    directory cannot overwrite the file this run's children read."""
    hydra_dir = os.path.join(out_dir, ".hydra")
    os.makedirs(hydra_dir, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=f"resolved-{os.getpid()}-", suffix=".yaml", dir=hydra_dir)
    os.close(fd)
    OmegaConf.save(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)), path)
    return path
