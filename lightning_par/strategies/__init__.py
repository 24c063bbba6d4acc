"""Layer 2: one Lightning ``Strategy`` subclass per technique (thin: mesh + layer-1 calls + plumbing)."""

from lightning_par.strategies.ddp import DDPStrategy
from lightning_par.strategies.fsdp import FSDPStrategy
from lightning_par.strategies.single import SingleDeviceStrategy
from lightning_par.strategies.zero import Zero1Strategy, Zero2Strategy, Zero3OffloadStrategy, Zero3Strategy

__all__ = ["DDPStrategy", "FSDPStrategy", "SingleDeviceStrategy", "Zero1Strategy", "Zero2Strategy",
           "Zero3OffloadStrategy", "Zero3Strategy"]
