"""Layer 3: demo LightningModules. Architectures hold no parallelism; each declares its plan.

The LightningModules are imported lazily, so layer-1 code and tests that need only an
architecture (``lightning_par.models.gpt``) do not pay for importing Lightning.
"""

from lightning_par.parallel.contract import ParallelPlan

__all__ = ["CNNModule", "GPTModule", "MLPModule", "MoEModule", "ParModule", "ParallelPlan", "from_pretrained"]


def __getattr__(name: str):
    if name in ("CNNModule", "GPTModule", "MLPModule", "ParModule"):
        from lightning_par.models import module

        return getattr(module, name)
    if name == "from_pretrained":  # a Hugging Face checkpoint the strategy fills shard by shard
        from lightning_par.models.hf.pretrained import from_pretrained

        return from_pretrained
    if name == "MoEModule":
        from lightning_par.models.moe_module import MoEModule

        return MoEModule
    raise AttributeError(f"module 'lightning_par.models' has no attribute {name!r}")
