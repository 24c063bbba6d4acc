"""Experiment loggers from the ``logger`` config group, and the run's config as their hyper-parameters.

Every file of the group declares its own package (``# @package logger.csv``), so one or several can
be chosen: ``logger=csv`` gives ``cfg.logger = {csv: {...}}``, ``logger=[csv,tensorboard,wandb,mlflow]``
gives four entries, ``~logger`` none. A user's logger config without that header lands directly
at ``cfg.logger`` (it has a ``_target_``) and is taken as the one logger.

``log_run_config`` records the whole resolved run config -- strategy, trainer, data, model,
callbacks, plus the chosen config names and the mesh -- as the loggers' hyper-parameters, next to
the model's own (which Lightning logs at fit start). The nested dict goes to every logger as it is:
Lightning's TensorBoard and MLflow loggers flatten it themselves (``trainer/devices``), CSV and
TensorBoard keep it nested in ``hparams.yaml``, W&B keeps it nested in its run config.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from hydra.utils import instantiate
from lightning.pytorch.loggers import Logger
from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from lightning_par import ConfigError


class WandbLogger(_LightningWandbLogger):
    """Lightning's ``WandbLogger`` that also ends its W&B run when training ends. Lightning's leaves
    the run open (so a script may keep logging to it); here one job is one run: the offline run is
    closed when the job ends (its exit record written, so ``wandb sync`` uploads a finished run), and
    the next job of a multirun, in the same process, starts its own run instead of logging into this one."""

    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        if self._experiment is not None and not getattr(self, "_lp_finished", False):
            self._lp_finished = True
            self._experiment.finish(exit_code=0 if status == "success" else 1)


def build_loggers(cfg_logger: Mapping[str, Any] | None) -> list[Logger] | bool:
    """The loggers ``cfg.logger`` selects, in config order; ``False`` (Lightning: no logger) for none."""
    if not cfg_logger:
        return False
    nodes = {"logger": cfg_logger} if "_target_" in cfg_logger else dict(cfg_logger)
    nodes = {name: node for name, node in nodes.items() if node is not None}
    for name, node in nodes.items():  # all checked before any is created
        if not isinstance(node, Mapping) or "_target_" not in node:
            raise ConfigError(f"logger.{name} has no _target_; a logger config chosen together with others needs "
                              f"the header '# @package logger.<its name>'")
    loggers: list[Logger] = []
    for name, node in nodes.items():
        if str(node.get("tracking_uri") or "").startswith("file:"):
            # MLflow 3 refuses its file store (kept, but "in maintenance mode") unless this is set; a local
            # directory in the run dir needs no server and no database package (mlflow-skinny has none)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            logger = instantiate(node)
        except Exception as e:  # hydra wraps constructor errors; show the cause in one line
            cause = e.__cause__ or e
            raise ConfigError(f"logger {name}: {type(cause).__name__}: {cause}") from None
        if not isinstance(logger, Logger):
            raise ConfigError(f"logger {name}: {node['_target_']} is not a Lightning Logger")
        loggers.append(logger)
    return loggers or False


def run_config(cfg: DictConfig, strategy: Any = None) -> dict[str, Any]:
    """The run's resolved config as plain nested Python, with ``choices`` (the config name picked in
    each group: ``strategy: zero3``, read from Hydra when it is running) and, given the strategy
    object, ``world_size`` and ``mesh`` (axis -> size)."""
    try:
        params = OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError:  # outside a Hydra run (${hydra:...} cannot resolve): as written
        params = OmegaConf.to_container(cfg, resolve=False)
    choices = _hydra_choices()
    if choices:
        params["choices"] = choices
    if strategy is not None and callable(getattr(strategy, "dims_for", None)):
        from lightning_par.run.facts import world_size

        world = 1 if getattr(strategy, "single_process", False) else world_size(cfg)
        params["world_size"] = world
        try:
            params["mesh"] = strategy.dims_for(world).sizes()
        except ValueError:  # an impossible mesh: validation reports it before anything runs
            pass
    return params


def log_run_config(loggers: Sequence[Logger] | bool, cfg: DictConfig, strategy: Any = None) -> Sequence[Logger] | bool:
    """Log ``run_config(cfg, strategy)`` as hyper-parameters to every logger (global rank 0 only:
    Lightning's loggers ignore the call elsewhere); returns ``loggers``."""
    if loggers:
        params = run_config(cfg, strategy)
        for logger in loggers:
            logger.log_hyperparams(params)
    return loggers


def _hydra_choices() -> dict[str, str]:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    choices = HydraConfig.get().runtime.choices
    return {k: str(v) for k, v in choices.items() if not k.startswith("hydra") and v is not None}


__all__ = ["WandbLogger", "build_loggers", "log_run_config", "run_config"]
