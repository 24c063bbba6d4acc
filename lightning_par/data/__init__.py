"""Layer 4: LightningDataModules needing no download, with a data-parallel-size independent order."""

from lightning_par.data.datamodules import (
    ParDataModule,
    SyntheticImages,
    SyntheticTokens,
    SyntheticVectors,
    TextDataModule,
    micro_batch_size,
)
from lightning_par.data.sampler import DataParallelSampler
from lightning_par.data.tokens import TokenFileDataModule

__all__ = ["DataParallelSampler", "ParDataModule", "SyntheticImages", "SyntheticTokens", "SyntheticVectors",
           "TextDataModule", "TokenFileDataModule", "micro_batch_size"]
