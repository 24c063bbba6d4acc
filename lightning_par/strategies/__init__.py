"""Layer 2: one Lightning ``Strategy`` subclass per technique (thin: mesh + layer-1 calls + plumbing)."""

from lightning_par.strategies.ddp import DDPStrategy
from lightning_par.strategies.single import SingleDeviceStrategy

__all__ = ["DDPStrategy", "SingleDeviceStrategy"]
