"""Derived facts of a run, one function each, used by training, ``mode=estimate`` and the advisor.

- ``world_size(cfg)``: processes in the run (torchrun's ``WORLD_SIZE`` when under torchrun, else
  ``trainer.devices`` -- ``auto``/``-1`` = the visible GPUs, else 1 -- times ``trainer.num_nodes``);
- ``micro_batch_size(global, dp, accumulate)``: the per-rank batch of one forward/backward;
- ``strategy_config(name, overrides)`` / ``strategy_of(strategy_cfg)`` / ``mesh_of(strategy, world)``:
  a strategy built from its config group exactly as a run builds it, and the mesh its own
  ``dims_for`` declares (pp, dp_replicate, dp_shard, tp for every strategy, 3d and fsdp_tp included);
- ``gpt_shape(model_cfg, seq_len)``: the GPT's shape from the module the config builds (its preset
  plus overrides), not from a copy of the presets.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lightning_par import ConfigError


def torchrun_world() -> tuple[int, int] | None:
    """(processes per node, nodes) as torchrun started them (``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``), or
    None outside torchrun. Under torchrun these, not ``trainer.devices``, are the world."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return local, max(1, world // max(1, local))


def micro_batch_size(global_batch_size: int, dp_size: int, accumulate: int = 1) -> int:
    """The per-rank batch of one forward/backward: the one rule is a data fact (``data/sampler.py``),
    imported here when asked, so that this module stays light (the app reads the world size before it
    imports Lightning, ``cli._prestart_fork_server``)."""
    from lightning_par.data.sampler import micro_batch_size as rule

    return rule(global_batch_size, dp_size, accumulate)


def accelerator(trainer_cfg: Any) -> str:
    acc = str(trainer_cfg.get("accelerator", "auto"))
    if acc in ("auto", "gpu"):
        return "cuda" if torch.cuda.is_available() else ("cpu" if acc == "auto" else "gpu")
    return acc


def devices_per_node(trainer_cfg: Any) -> int:
    """``trainer.devices`` as a count: an int, a list of ids, or ``auto``/``-1`` (the visible GPUs
    on a GPU run, else 1 -- Lightning's CPU ``auto`` is one process)."""
    devices = trainer_cfg.get("devices", 1)
    if isinstance(devices, str) and devices not in ("auto", "-1"):
        devices = int(devices)
    if devices in ("auto", -1, "-1"):
        return torch.cuda.device_count() if accelerator(trainer_cfg) == "cuda" else 1
    if isinstance(devices, (list, tuple)) or hasattr(devices, "__len__"):
        return len(devices)
    return int(devices)


def world_size(cfg: Any) -> int:
    elastic = torchrun_world()
    if elastic is not None:
        return elastic[0] * elastic[1]
    return devices_per_node(cfg.trainer) * int(cfg.trainer.get("num_nodes", 1))


def strategy_config(name: str, overrides: list[str] | None = None) -> Any:
    """The ``strategy=<name>`` config group as a run composes it (with ``strategy.*`` overrides)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # inside a Hydra app: compose beside it
        return compose("config", overrides=[f"strategy={name}", *(overrides or [])]).strategy
    with initialize_config_module("lightning_par.conf", version_base="1.3"):
        return compose("config", overrides=[f"strategy={name}", *(overrides or [])]).strategy


def strategy_of(strategy_cfg: Any) -> tuple[Any, dict[str, int]]:
    """(the strategy object, its tiling option) built as ``train.build`` builds them."""
    from hydra.utils import instantiate

    from lightning_par.run.tiling_option import pop_tiling

    rest, tiling = pop_tiling(strategy_cfg)
    try:
        return instantiate(rest), tiling
    except Exception as e:  # hydra wraps constructor errors; show the cause in one line
        cause = e.__cause__ or e
        raise ConfigError(f"{type(cause).__name__}: {cause}") from None


def mesh_of(strategy: Any, world: int):
    """The ``ParallelDims`` the strategy builds for ``world`` processes (its own ``dims_for``)."""
    from lightning_par.parallel.mesh import ParallelDims

    if getattr(strategy, "single_process", False):
        return ParallelDims()
    dims_for = getattr(strategy, "dims_for", None)
    if not callable(dims_for):
        return ParallelDims(dp_replicate=world)
    try:
        dims = dims_for(world)
        dims.validate(world)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return dims


def gpt_shape(model_cfg: Any, seq_len: int | None = None):
    """The ``costs.shape.Shape`` of the GPT or MoE decoder that ``model_cfg`` builds, as the module
    declares it (``cost_shape``, read by ``Shape.of_model``) at ``seq_len`` (default: the module's);
    None for other models."""
    from lightning_par.models.build import instantiate_model

    from lightning_par.costs.shape import Shape
    from lightning_par.models.module import GPTModule

    target = str(model_cfg.get("_target_", ""))
    if not target.endswith(("GPTModule", "MoEModule")):
        return None
    try:
        module = instantiate_model(model_cfg)  # builds no layers: GPTModule resolves its config only
    except Exception as e:
        cause = e.__cause__ or e
        raise ConfigError(f"{type(cause).__name__}: {cause}") from None
    assert isinstance(module, GPTModule)
    return Shape.of_model(module, seq_len or module.seq_len)
