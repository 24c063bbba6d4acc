"""Layer 3: demo LightningModules. Architectures hold no parallelism; each declares its plan."""

from lightning_par.models.module import CNNModule, GPTModule, MLPModule, ParModule
from lightning_par.models.plan import ParallelPlan

__all__ = ["CNNModule", "GPTModule", "MLPModule", "ParModule", "ParallelPlan"]
