"""A data order that does not depend on the data-parallel size.

One permutation of the dataset (seeded, re-drawn per epoch) is cut into consecutive global
micro-batches of ``dp_size * micro_batch`` samples; rank ``r`` takes the ``r``-th slice of each.
So the union of the ranks' batches at step ``i`` is exactly the single-device batch at step ``i``
-- the precondition of the loss-parity rule. Samples that do not fill a whole global micro-batch
at the end of an epoch are dropped (every rank runs the same number of whole optimizer steps).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from lightning_par import ConfigError


class DataParallelSampler(Sampler[int]):
    def __init__(self, n_samples: int, *, micro_batch: int, dp_rank: int = 0, dp_size: int = 1,
                 accumulate: int = 1, shuffle: bool = True, seed: int = 0) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"DataParallelSampler: dp_rank={dp_rank} outside [0, {dp_size})")
        self.n_samples = n_samples
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.global_micro = micro_batch * dp_size
        # whole optimizer steps only: a partial accumulation at the epoch's end would be a step the
        # single-device run (one micro-batch per step) does not have
        self.n_micro_batches = n_samples // (self.global_micro * accumulate) * accumulate

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n_micro_batches * self.micro_batch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n_samples, generator=g)
        else:
            order = torch.arange(self.n_samples)
        b, start = self.micro_batch, self.dp_rank * self.micro_batch
        for t in range(self.n_micro_batches):
            base = t * self.global_micro + start
            yield from order[base : base + b].tolist()


def micro_batch_size(global_batch_size: int, dp_size: int, accumulate: int = 1) -> int:
    """Per-rank batch of one forward/backward; errors unless it divides exactly."""
    denom = dp_size * accumulate
    if global_batch_size < 1 or global_batch_size % denom:
        raise ConfigError(
            f"data.global_batch_size={global_batch_size} is not divisible by data-parallel size {dp_size}"
            f" x accumulate_grad_batches {accumulate} = {denom}; pick a multiple of {denom}"
        )
    return global_batch_size // denom
