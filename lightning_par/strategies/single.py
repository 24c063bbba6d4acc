"""``single``: one device, no communication -- the reference every other strategy must match.

Checkpoints use the same sharded, strategy-neutral format as every other strategy (``checkpoint.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.data import has_iterable_dataset
from lightning.pytorch.strategies import SingleDeviceStrategy as _LightningSingleDevice
# Lightning's own helpers for the sampler it injects under distributed strategies (the same call)
from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _is_dataloader_shuffled, _update_dataloader
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_par.parallel.mesh import ParallelDims
from lightning_par.strategies.base import ParStrategyMixin
from lightning_par.strategies.checkpoint.dcp import DistributedCheckpointMixin


class SingleDeviceStrategy(ParStrategyMixin, DistributedCheckpointMixin, _LightningSingleDevice):
    """Train on one device: the first GPU when there is one, else the CPU.

    Args:
        device: ``"auto"`` or a torch device string.
        activation_checkpointing: true or "full" recomputes each block in backward, "selective" keeps matmuls,
            k (an int) recomputes every k-th block.
    """

    strategy_name = "lp_single"
    #: one process whatever ``trainer.devices`` says, so ``-m strategy=single,ddp trainer.devices=2`` sweeps work
    single_process = True

    def __init__(self, device: str = "auto", activation_checkpointing: bool | str = False, **kwargs: Any) -> None:
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

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """A user's loader gets the sampler every data-parallel strategy gets, at one rank: under a
        distributed strategy Lightning replaces the loader's sampler with its ``DistributedSampler``
        (shuffled for training, seeded by ``PL_GLOBAL_SEED``), whose order at any number of ranks
        concatenates to one permutation; Lightning's single-device strategy keeps the loader's own
        order, so the reference run would train on other batches than every strategy it is compared
        with. The app's data modules bring their own sampler (``use_distributed_sampler=false``)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if (trainer is not None and isinstance(dataloader, DataLoader)
                and trainer._accelerator_connector.use_distributed_sampler
                and not isinstance(dataloader.sampler, DistributedSampler) and not has_iterable_dataset(dataloader)):
            stage = trainer.state.stage
            shuffle = True if stage == RunningStage.TRAINING else _is_dataloader_shuffled(dataloader)
            sampler = _get_distributed_sampler(dataloader, shuffle, overfit_batches=trainer.overfit_batches,
                                               mode=stage, num_replicas=1, rank=0)
            dataloader = _update_dataloader(dataloader, sampler, mode=stage)
        return super().process_dataloader(dataloader)  # then resumable, as under every strategy
