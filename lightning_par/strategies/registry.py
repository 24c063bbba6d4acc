"""lightning_par's strategies in Lightning's ``StrategyRegistry``, and one-line configuration errors
for scripts that use them from their own ``Trainer``.

Derived from the strategy catalogue (``strategies/catalog.py``): names mirror the config files
(``lp_`` + ``conf/strategy/<name>.yaml``); presets that are a class with fixed arguments (``hsdp``)
register those arguments too.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType

from lightning.pytorch.strategies import StrategyRegistry

from lightning_par import ConfigError
from lightning_par.strategies.catalog import CATALOG


def register_strategies() -> None:
    """Every catalogue entry (``strategies/catalog.py``) as ``lp_<name>``; a preset registers its
    fixed arguments (``lp_hsdp``: FSDPStrategy with replicate=2)."""
    for e in CATALOG:
        if e.registry_name not in StrategyRegistry:
            StrategyRegistry.register(e.registry_name, e.strategy_class(), description=f"lightning_par: {e.description}",
                                      **e.preset)
    _install_config_error_hook()


def _install_config_error_hook() -> None:
    """An uncaught ``ConfigError`` in a script prints one ``error:`` line (from rank 0 only) instead of
    a traceback through Lightning's fit loop; every other exception is left to the previous hook.
    Interactive sessions (IPython, notebooks) use their own display and are not affected."""
    previous = sys.excepthook
    if getattr(previous, "_lightning_par", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if isinstance(value, ConfigError):
            if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":
                # the real stderr: torch's distributed excepthook buffers sys.stderr to prefix "[rankN]"
                sys.__stderr__.write(f"error: {value}\n")
                sys.__stderr__.flush()
            sys.stdout.flush()
            # skip interpreter finalization: with a process group still alive, gloo's threads can
            # hold the exit for many seconds; nothing is left to clean up after a config error
            os._exit(1)
        previous(kind, value, tb)

    hook._lightning_par = True  # type: ignore[attr-defined]
    sys.excepthook = hook
