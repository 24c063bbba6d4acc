"""``model.float8``, from the config to the strategy: a choice about the model's arithmetic that no model
constructor takes (``models/build.RUN_OPTIONS``), applied by every lightning_par strategy
(``parallel/precision/float8.py``). Entry layer: ``float8_of`` reads it from the model's config node;
``set_float8`` checks it (value, strategy, device) and hands it to the strategy, before any process starts."""

from __future__ import annotations

from typing import Any

from lightning_par import ConfigError
from lightning_par.parallel.precision.float8 import device_refusal, float8_option, missing_torchao
from lightning_par.strategies.base import ParStrategyMixin


def float8_of(model_cfg: Any) -> str | None:
    """The model's ``float8`` option as a recipe name or None (the model is built without it:
    ``models/build.instantiate_model``)."""
    from omegaconf import DictConfig

    if not isinstance(model_cfg, DictConfig) or "float8" not in model_cfg:
        return None
    try:
        return float8_option(model_cfg.float8)
    except ValueError as e:
        raise ConfigError(f"model.{e}") from None


def set_float8(strategy: Any, recipe: str | None, accelerator: str) -> None:
    """Hand ``model.float8`` to a lightning_par strategy, after checking that the strategy is one and that
    the accelerator has float8 (a CUDA GPU below compute capability 8.9 has not; CPU emulates)."""
    if recipe is None:
        return
    if not isinstance(strategy, ParStrategyMixin):
        raise ConfigError(f"model.float8={recipe} needs a lightning_par strategy, not {type(strategy).__name__}")
    if missing_torchao():
        raise ConfigError(f"model.{missing_torchao()}")
    if accelerator == "cuda":
        import torch

        refusal = device_refusal(torch.device("cuda", 0)) if torch.cuda.is_available() else None
        if refusal:
            raise ConfigError(f"model.{refusal}")
    strategy.float8 = recipe
