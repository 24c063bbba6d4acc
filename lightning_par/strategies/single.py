"""``single``: one device, no communication -- the reference every other strategy must match.

Checkpoints use the same sharded, strategy-neutral format as every other strategy (``checkpoint.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy as _LightningSingleDevice
from typing_extensions import override

from lightning_par.parallel.mesh import ParallelDims
from lightning_par.strategies.base import ParStrategyMixin
from lightning_par.strategies.checkpoint import DistributedCheckpointMixin


class SingleDeviceStrategy(ParStrategyMixin, DistributedCheckpointMixin, _LightningSingleDevice):
    """Train on one device: the first GPU when there is one, else the CPU.

    Args:
        device: ``"auto"`` or a torch device string.
        activation_checkpointing: recompute each block's activations in backward.
    """

    strategy_name = "lp_single"
    #: one process whatever ``trainer.devices`` says, so ``-m strategy=single,ddp trainer.devices=2`` sweeps work
    single_process = True

    def __init__(self, device: str = "auto", activation_checkpointing: bool = False, **kwargs: Any) -> None:
        if device == "auto":
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        super().__init__(device=torch.device(device), **kwargs)
        self.activation_checkpointing = activation_checkpointing

    def dims_for(self, world_size: int) -> ParallelDims:
        if world_size != 1:
            raise ValueError(f"strategy single runs one process, not {world_size}; use strategy=ddp for more")
        return ParallelDims()

    @override
    def setup(self, trainer: Any) -> None:
        self.prepare_model(self.lightning_module)  # checkpointing, compile, materialisation (parallelize's order)
        super().setup(trainer)  # Lightning's: device, (DDP wrapper), optimizers
