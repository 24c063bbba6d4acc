"""``ddp``: data parallelism with torch's ``DistributedDataParallel`` (gloo on CPU, NCCL on CUDA).

Every rank holds the full model, optimizer and gradients; gradients are averaged by bucketed
all-reduce overlapped with backward. This is Lightning's ``DDPStrategy`` with (a) the
multirun-safe launcher, (b) SyncBatchNorm as a strategy option (so a config file can turn it on),
(c) optional per-block activation checkpointing from the model's plan, and (d) sharded,
strategy-neutral checkpoints (``checkpoint.py``), so a DDP checkpoint resumes under any strategy.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.strategies import DDPStrategy as _LightningDDP
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_par import ConfigError
from lightning_par.strategies.base import GlobalSyncBatchNorm, ParStrategyMixin, destroy_process_group_at_exit
from lightning_par.strategies.checkpoint.dcp import DistributedCheckpointMixin

__all__ = ["DDPStrategy", "GlobalSyncBatchNorm"]

# torch's reducer, at the forward after a backward in which some parameter got no gradient
_UNUSED = "Expected to have finished reduction in the prior iteration"


class DDPStrategy(ParStrategyMixin, DistributedCheckpointMixin, _LightningDDP):
    """Distributed data parallel.

    Args:
        sync_batchnorm: convert BatchNorm layers to SyncBatchNorm (statistics over the global batch).
        bucket_cap_mb: gradient bucket size for the all-reduce (torch's default 25).
        gradient_as_bucket_view: let ``.grad`` alias the communication buckets (saves one gradient copy).
        static_graph: the graph is the same every step (enables DDP's optimizations).
        find_unused_parameters: tolerate parameters that get no gradient (slower).
        activation_checkpointing: true or "full" recomputes each block in backward, "selective" keeps matmuls,
            k (an int) recomputes every k-th block.
        process_group_backend: None picks gloo on CPU and NCCL on CUDA.
    """

    strategy_name = "lp_ddp"

    def __init__(self, sync_batchnorm: bool = False, bucket_cap_mb: float = 25.0, gradient_as_bucket_view: bool = True,
                 static_graph: bool = False, find_unused_parameters: bool = False,
                 activation_checkpointing: bool | str = False, process_group_backend: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(process_group_backend=process_group_backend, bucket_cap_mb=bucket_cap_mb,
                         gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
                         find_unused_parameters=find_unused_parameters, **kwargs)
        self.sync_batchnorm = sync_batchnorm
        self.activation_checkpointing = activation_checkpointing

    # ``sync_batchnorm`` / ``Trainer(sync_batchnorm=True)``: see ``ParStrategyMixin._layer_sync``. Every
    # rank is a data-parallel rank, so the group is the default one. torch's SyncBatchNorm refuses CPU
    # modules, so on CPU the global-statistics BatchNorm of layer 1 is used.
    @override
    def layer_sync_plugin(self) -> LayerSync:
        return TorchSyncBatchNorm() if self.root_device.type == "cuda" else GlobalSyncBatchNorm()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().training_step(*args, **kwargs)
        except RuntimeError as e:
            if _UNUSED not in str(e):
                raise
            raise ConfigError(self._unused_parameters_message(str(e))) from None

    def _unused_parameters_message(self, torch_message: str) -> str:
        """One line naming the parameters that got no gradient (torch gives their indices among the
        module's trainable parameters, in ``named_parameters`` order) and lightning_par's option."""
        names = [n for n, p in self.lightning_module.named_parameters() if p.requires_grad
                 and n not in getattr(self.model, "parameters_to_ignore", ())]
        found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", torch_message)
        indices = [int(i) for i in found.group(1).split()] if found else []
        which = [names[i] for i in indices if i < len(names)]
        what = (f"parameter(s) {', '.join(which[:5])}{' ...' if len(which) > 5 else ''}" if which
                else "some parameters")
        cls = type(self).__name__
        return (f"{self.strategy_name}: {what} got no gradient in a training step (unused in the loss, or in a "
                f"branch not taken every step), which DistributedDataParallel must be told: use "
                f"Trainer(strategy=lightning_par.strategies.{cls}(find_unused_parameters=True)), or "
                f"strategy.find_unused_parameters=true in the lightning_par app")

    def validate_setup(self, world_size: int, module: Module) -> None:
        super().validate_setup(world_size, module)
        # extra keyword arguments go to DistributedDataParallel at setup; catch typos before launching
        unknown = sorted(set(self._ddp_kwargs) - set(inspect.signature(DistributedDataParallel).parameters))
        if unknown:
            hint = ("; CPU offload exists only in strategy=zero3_offload and strategy=fsdp (cpu_offload: true)"
                    if any("offload" in k for k in unknown) else "")
            raise ValueError(f"{type(self).__name__}: unknown option(s) {', '.join(unknown)} "
                             f"(not DistributedDataParallel arguments){hint}")

    @override
    def _configure_launcher(self) -> None:
        self._launcher = self._make_launcher()

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()  # Lightning's: ranks, device, process group
        destroy_process_group_at_exit()

    @override
    def setup(self, trainer: Any) -> None:
        self.prepare_model(self.lightning_module)  # checkpointing, compile, materialisation (parallelize's order)
        super().setup(trainer)  # Lightning's: device, (DDP wrapper), optimizers
