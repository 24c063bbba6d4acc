"""``strategy.tiling``, from the config to the strategy: an option of every lightning_par strategy that is
not a constructor argument. Entry layer: it reads the strategy's config node (``pop_tiling``) and hands
the checked option to a built strategy (``set_tiling``); the tiling itself is plain torch
(``parallel/memory/tiling.py``)."""

from __future__ import annotations

from torch import nn

from lightning_par import ConfigError
from lightning_par.parallel.memory.tiling import check_tiling, with_tied_partners
from lightning_par.strategies.base import ParStrategyMixin


def pop_tiling(strategy_cfg: object) -> tuple[object, dict[str, int]]:
    """The strategy's config without its ``tiling`` key (an option of every lightning_par strategy,
    not a constructor argument), and that option as a plain, checked dict."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(strategy_cfg, DictConfig) or "tiling" not in strategy_cfg:
        return strategy_cfg, {}
    tiling = OmegaConf.to_container(strategy_cfg.tiling, resolve=True) if strategy_cfg.tiling is not None else None
    rest = OmegaConf.create({k: v for k, v in OmegaConf.to_container(strategy_cfg).items() if k != "tiling"})
    return rest, check_tiling(tiling)  # type: ignore[arg-type]


def set_tiling(strategy: object, tiling: dict[str, int], model: nn.Module | None = None) -> None:
    """Hand the ``tiling`` option to a lightning_par strategy (read by ``prepare_model``), after
    checking it against ``model`` (built on the meta device) so that a wrong path or tile count is
    one line before any process starts."""
    if tiling and not isinstance(strategy, ParStrategyMixin):
        raise ConfigError(f"strategy.tiling needs a lightning_par strategy, not {type(strategy).__name__}")
    if model is not None and tiling:
        with_tied_partners(model, tiling)  # every path, and a tied pair named with two counts
    if isinstance(strategy, ParStrategyMixin):
        strategy.tiling = tiling
