"""Layer 2: one Lightning ``Strategy`` subclass per technique (thin: mesh + layer-1 calls + plumbing).

Importing this package registers every strategy in Lightning's ``StrategyRegistry`` under its
``lp_`` name, so a user's own script can write ``Trainer(strategy="lp_zero3")``.
"""

from lightning_par.strategies.composite import FSDPTPStrategy, MeshParallelStrategy, Parallel3DStrategy
from lightning_par.strategies.ddp import DDPStrategy
from lightning_par.strategies.expert_parallel import ExpertParallelStrategy
from lightning_par.strategies.fsdp import FSDPStrategy
from lightning_par.strategies.pipeline import PipelineStrategy
from lightning_par.strategies.registry import register_strategies
from lightning_par.strategies.single import SingleDeviceStrategy
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy
from lightning_par.strategies.zero import Zero1Strategy, Zero2Strategy, Zero3OffloadStrategy, Zero3Strategy

__all__ = ["DDPStrategy", "ExpertParallelStrategy", "FSDPStrategy", "FSDPTPStrategy", "MeshParallelStrategy", "Parallel3DStrategy",
           "PipelineStrategy", "SingleDeviceStrategy", "TensorParallelStrategy", "Zero1Strategy", "Zero2Strategy",
           "Zero3OffloadStrategy", "Zero3Strategy"]

register_strategies()
