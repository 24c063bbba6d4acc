"""Techniques that shard parameters, gradients and optimizer states over data-parallel ranks: FSDP2
(``fsdp``), ZeRO stages 1-3 (``zero``), the disk tier (``disk_offload``), gradient reduction (``gradients``) and
SyncBatchNorm (``sync_batchnorm``)."""
