"""Lightning's own ``LightningCLI`` builds our strategies from their class paths with typed options.

jsonargparse converts each command-line value by the constructor's type hints; a hint that tries
``str`` before ``int`` turned ``--trainer.strategy.units=1`` (a minimum parameter count) into the
class name '1'. No process starts here (``run=False``): the strategy object is what is checked.
"""

from __future__ import annotations

import pytest
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel


def _strategy(*args: str):
    cli = LightningCLI(BoringModel, run=False, save_config_callback=None,
                       args=["--trainer.accelerator=cpu", "--trainer.logger=false", *args])
    return cli.trainer.strategy


def test_lightning_cli_passes_typed_strategy_options():
    fsdp = _strategy("--trainer.strategy=lightning_par.strategies.FSDPStrategy", "--trainer.strategy.units=1000",
                     "--trainer.strategy.prefetch=2")
    assert type(fsdp).__name__ == "FSDPStrategy"
    assert fsdp.units == 1000 and isinstance(fsdp.units, int) and fsdp.fsdp_options.prefetch == 2
    named = _strategy("--trainer.strategy=lightning_par.strategies.FSDPStrategy", "--trainer.strategy.units=Block")
    assert named.units == "Block"
    zero2 = _strategy("--trainer.strategy=lightning_par.strategies.Zero2Strategy",
                      "--trainer.strategy.bucket_cap_mb=5", "--trainer.strategy.collectives=reduce_scatter")
    assert zero2.bucket_cap_mb == 5.0 and zero2.collectives == "reduce_scatter"


def test_lightning_cli_bad_option_is_refused():
    with pytest.raises(SystemExit):  # jsonargparse's own one-line usage error, before anything runs
        _strategy("--trainer.strategy=lightning_par.strategies.Zero2Strategy", "--trainer.strategy.bucket_cap_mb=abc")
