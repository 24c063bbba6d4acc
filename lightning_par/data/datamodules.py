"""LightningDataModules that need no download.

- ``TextDataModule``: byte-level language modelling on text files already on every machine --
  by default the Python standard library's own ``.py`` sources (read in sorted order, so the
  corpus is identical on every rank). Samples are non-overlapping windows of ``seq_len + 1``
  bytes; the last ``val_fraction`` of the corpus is held out for validation.
- ``SyntheticTokens``: random tokens, for benchmarks (no I/O, any size).
- ``SyntheticVectors`` / ``SyntheticImages``: learnable classification data for the MLP and CNN.

``global_batch_size`` is the user's knob: samples per optimizer step over all data-parallel ranks.
The per-rank micro-batch follows from the data-parallel size (read from the strategy) and
gradient accumulation; a size that does not divide raises ``ConfigError``.

Mid-epoch resume: the loaders here are plain ``DataLoader``s; the strategies wrap the training one
in ``strategies/checkpoint/dcp.py``'s ``ResumableLoader``. torchdata's ``StatefulDataLoader`` does not
replace it: its state is per rank (batches this rank yielded, plus the sampler's own state; "not
across ranks", its documentation says), so a checkpoint resumed on a different data-parallel size
-- which lightning_par supports, e.g. zero3 on 4 ranks resumed under ddp on 2 -- would skip the
wrong number of samples. ``ResumableLoader`` records the position in samples of the global,
dp-size independent order, and otherwise fast-forwards the same way (by re-drawing the skipped
micro-batches); it also needs no extra dependency.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_par import ConfigError
from lightning_par.data.sampler import DataParallelSampler, micro_batch_size  # noqa: F401 -- re-exported


class WindowDataset(Dataset):
    """Non-overlapping (input, next-token target) windows over a 1-D token tensor."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class ParDataModule(L.LightningDataModule):
    """Shared batching: data-parallel-size independent order, micro-batch from the global batch."""

    #: what the data produces (must match the model's ``input_kind``)
    kind: str = "tokens"

    def __init__(self, global_batch_size: int = 32, seed: int = 0, shuffle: bool = True, num_workers: int = 0,
                 pin_memory: bool | None = None, persistent_workers: bool | None = None,
                 prefetch_factor: int | None = None):
        super().__init__()
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        if num_workers < 0 or (prefetch_factor is not None and (num_workers == 0 or prefetch_factor < 1)):
            raise ConfigError(f"data: num_workers={num_workers} must be >= 0, and prefetch_factor={prefetch_factor} "
                              "needs num_workers > 0 and is at least 1")
        if persistent_workers and num_workers == 0:
            raise ConfigError("data.persistent_workers=true needs data.num_workers > 0")
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def _build(self) -> tuple[Dataset, Dataset]:
        raise NotImplementedError

    def split_sizes(self) -> tuple[int, int] | None:
        """(training samples, validation samples), when known before any process starts without reading
        the data (token files: from their headers); None: known only once ``setup`` has built the sets."""
        return None

    def describe(self) -> str:
        """The data's name in a message (a token corpus names its path)."""
        return type(self).__name__

    def check_splits(self, validating: bool) -> None:
        """One ``ConfigError`` line naming the split, before any process starts, when the training split --
        or, if the run validates, the validation split -- cannot fill one global batch (each loader yields
        whole global batches only; found after launch, every rank would print the same error)."""
        sizes = self.split_sizes()
        if sizes is None:
            return
        g = int(self.global_batch_size)
        for split, n, validates in (("training", sizes[0], True), ("validation", sizes[1], validating)):
            if validates and n < g:
                raise ConfigError(self.split_too_small(split, n, g))

    def split_too_small(self, split: str, n: int, global_batch: int) -> str:
        fix = ("lower data.global_batch_size or add data" if split == "training" else
               "lower data.global_batch_size, raise data.val_fraction, add data, or validate less "
               "(trainer.limit_val_batches=0: no validation)")
        return (f"the {split} split of {self.describe()} has {n} samples, fewer than one global batch of "
                f"{global_batch}: {fix}")

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = self._build()

    def dp_coordinates(self) -> tuple[int, int]:
        """(rank, size) along the data-parallel axis, from the attached trainer's strategy."""
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))

    def _loader(self, dataset: Dataset, *, shuffle: bool, accumulate: int) -> DataLoader:
        rank, size = self.dp_coordinates()
        micro = micro_batch_size(self.global_batch_size, size, accumulate)
        sampler = DataParallelSampler(len(dataset), micro_batch=micro, dp_rank=rank, dp_size=size,
                                      accumulate=accumulate, shuffle=shuffle, seed=self.seed)
        if sampler.n_micro_batches == 0:
            raise ConfigError(f"{type(self).__name__}: {len(dataset)} samples cannot fill one global batch of "
                              f"{micro * size}; lower data.global_batch_size or add data")
        return DataLoader(dataset, batch_size=micro, sampler=sampler, drop_last=True, **self.loader_options())

    def loader_options(self) -> dict[str, Any]:
        """DataLoader settings; unset ones follow the device: pinned host memory only when batches go to
        a GPU (faster, asynchronous copies), workers kept alive between epochs when there are any."""
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        pin = self.pin_memory if self.pin_memory is not None else getattr(device, "type", "cpu") == "cuda"
        options: dict[str, Any] = dict(num_workers=self.num_workers, pin_memory=pin,
                                       persistent_workers=(self.persistent_workers if self.persistent_workers
                                                           is not None else self.num_workers > 0))
        if self.num_workers > 0:
            options["prefetch_factor"] = self.prefetch_factor or 2  # torch's default
        return options

    def train_dataloader(self) -> DataLoader:
        accumulate = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        return self._loader(self.train_set, shuffle=self.shuffle, accumulate=accumulate)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False, accumulate=1)


def stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(root, "*.py")))


class TextDataModule(ParDataModule):
    kind = "tokens"

    def __init__(self, files: str | list[str] | None = None, seq_len: int = 128, max_bytes: int = 4_000_000,
                 val_fraction: float = 0.05, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.files = files
        self.seq_len = seq_len
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        if files not in (None, "stdlib"):
            self._check_files()  # here, in the launching process: before any rank starts

    def _paths(self) -> list[str]:
        if self.files in (None, "stdlib"):
            return stdlib_files()
        patterns = [self.files] if isinstance(self.files, str) else list(self.files)
        matches = {p for pat in patterns for p in glob.glob(os.path.expanduser(pat), recursive=True)}
        paths = sorted(p for p in matches if not os.path.isdir(p))
        if not paths:
            raise ConfigError(f"TextDataModule: no files match {self.files!r}")
        return paths

    def _check_files(self) -> None:
        """One line naming the file when a data file cannot be read, or when every file is empty."""
        paths = self._paths()
        for path in paths:
            try:
                with open(path, "rb") as f:
                    f.read(1)
            except OSError as e:
                raise ConfigError(f"cannot read data file {path}: {e.strerror or e}") from None
        if all(os.path.getsize(p) == 0 for p in paths):
            raise ConfigError(f"data file {paths[0]} is empty" if len(paths) == 1
                              else f"data files are all empty: {', '.join(paths[:5])}")

    def read_corpus(self) -> torch.Tensor:
        data, total = [], 0
        for path in self._paths():
            with open(path, "rb") as f:
                chunk = f.read(self.max_bytes - total)
            data.append(chunk)
            total += len(chunk)
            if total >= self.max_bytes:
                break
        return torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8)

    def _build(self) -> tuple[Dataset, Dataset]:
        tokens = self.read_corpus()
        n_val = int(len(tokens) * self.val_fraction)
        return WindowDataset(tokens[: len(tokens) - n_val], self.seq_len), WindowDataset(
            tokens[len(tokens) - n_val :], self.seq_len)


def token_dtype(vocab_size: int) -> torch.dtype:
    """The smallest signed integer dtype holding token ids 0 .. vocab_size - 1 (int16 up to 32768)."""
    for dtype in (torch.int16, torch.int32):
        if vocab_size - 1 <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


class SyntheticTokens(ParDataModule):
    kind = "tokens"

    def __init__(self, n_samples: int = 4096, seq_len: int = 128, vocab_size: int = 256, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.n_samples, self.seq_len, self.vocab_size = n_samples, seq_len, vocab_size

    def _build(self) -> tuple[Dataset, Dataset]:
        g = torch.Generator().manual_seed(1234)
        tokens = torch.randint(0, self.vocab_size, (self.n_samples * (self.seq_len + 1) + 1,), generator=g,
                               dtype=token_dtype(self.vocab_size))
        split = int(len(tokens) * 0.95)
        return WindowDataset(tokens[:split], self.seq_len), WindowDataset(tokens[split:], self.seq_len)


class SyntheticVectors(ParDataModule):
    """Gaussian vectors labelled by a fixed random linear teacher (learnable, no download)."""

    kind = "vectors"

    def __init__(self, n_samples: int = 8192, in_dim: int = 32, n_classes: int = 10, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.n_samples, self.in_dim, self.n_classes = n_samples, in_dim, n_classes

    def _build(self) -> tuple[Dataset, Dataset]:
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(self.n_samples, self.in_dim, generator=g)
        teacher = torch.randn(self.in_dim, self.n_classes, generator=g)
        y = (x @ teacher).argmax(dim=1)
        split = int(self.n_samples * 0.9)
        return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


class SyntheticImages(ParDataModule):
    """Noisy images whose class sets which of a few fixed patterns is painted in."""

    kind = "images"

    def __init__(self, n_samples: int = 4096, channels: int = 3, image_size: int = 16, n_classes: int = 10,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.n_samples, self.channels, self.image_size, self.n_classes = n_samples, channels, image_size, n_classes

    def _build(self) -> tuple[Dataset, Dataset]:
        g = torch.Generator().manual_seed(1234)
        s = self.image_size
        patterns = torch.randn(self.n_classes, self.channels, s, s, generator=g)
        y = torch.randint(0, self.n_classes, (self.n_samples,), generator=g)
        x = patterns[y] + 0.5 * torch.randn(self.n_samples, self.channels, s, s, generator=g)
        split = int(self.n_samples * 0.9)
        return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])
