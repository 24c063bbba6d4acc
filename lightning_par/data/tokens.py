"""Pre-tokenized corpora: ``data=tokens data.path=GLOB`` reads token files written by ``lightning-par-prepare``.

File format: ``lightning_par/core/token_format.py`` (a 64-byte header, then the raw ids), and an
optional sidecar ``<file>.json``; a glob matching sidecars skips them.

Opening reads the 64-byte headers and the files' sizes, nothing else: the tokens are mapped with
``numpy.memmap`` on first access, per process (a DataLoader worker maps its own; the map is never
pickled, which would copy the file), so a 100 GB corpus opens in constant memory and time.

Samples: the sorted files are one token stream (windows cross file boundaries: prepare ends every
document with EOS, so a file boundary is just another document boundary, and no tail of any file is
wasted). Window ``i`` is tokens ``[i * seq_len, (i + 1) * seq_len + 1)``: inputs ``[:-1]``, targets
``[1:]`` -- the inputs never overlap and every token but the first is a target exactly once (the
convention of ``TextDataModule``'s windows and Megatron's). The last ``val_fraction`` of the windows
is validation. Every mistake (no file matches, a bad header, a truncated body, an empty corpus, a
corpus shorter than one sample) is one ``ConfigError`` line naming the path, raised at construction; a
training split -- or, when the run validates, a validation split -- smaller than one global batch is one
line naming the split, from the app's checks before launch (``check_splits``, called by ``train.validate``).
"""

from __future__ import annotations

import bisect
import glob
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_par import ConfigError
from lightning_par.data.datamodules import ParDataModule
from lightning_par.core.token_format import (  # noqa: F401 -- re-exported: the format's names beside the reader
    HEADER_BYTES, MAGIC, TokenFile, dtype_for, pack_header)


class TokenWindows(Dataset):
    """Windows ``[i * seq_len, (i + 1) * seq_len + 1)`` of the files' concatenation, for ``i`` in
    ``[first, first + count)``; the maps are opened on first access in each process."""

    def __init__(self, files: list[TokenFile], seq_len: int, first: int, count: int) -> None:
        self.files, self.seq_len, self.first, self.count = files, seq_len, first, count
        # starts[k]: the global index of file k's first token
        self.starts = np.cumsum([0] + [f.n_tokens for f in files])[:-1].tolist()
        self._maps: list[np.memmap] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # a DataLoader worker (spawned) maps the files itself: pickling a memmap would copy it whole
        return {**self.__dict__, "_maps": None}

    def maps(self) -> list[np.memmap]:
        if self._maps is None:
            # (numpy cannot map 0 bytes: an empty file is an empty array)
            self._maps = [np.memmap(f.path, dtype=f.dtype, mode="r", offset=HEADER_BYTES, shape=(f.n_tokens,))
                          if f.n_tokens else np.empty(0, f.dtype) for f in self.files]
        return self._maps

    def __len__(self) -> int:
        return self.count

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Global tokens ``[start, stop)`` as int64, across file boundaries."""
        maps, parts = self.maps(), []
        k = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            local = start - self.starts[k]
            take = min(stop - start, self.files[k].n_tokens - local)
            parts.append(maps[k][local : local + take])
            start += take
            k += 1
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(i)
        start = (self.first + i) * self.seq_len
        chunk = torch.from_numpy(self.tokens(start, start + self.seq_len + 1))
        return chunk[:-1], chunk[1:]


def token_paths(path: str | list[str]) -> list[str]:
    """The sorted files ``path`` (a glob or list of globs) matches; sidecars and directories left out."""
    patterns = [path] if isinstance(path, str) else list(path)
    found = {p for pat in patterns for p in glob.glob(os.path.expanduser(str(pat)), recursive=True)}
    paths = sorted(p for p in found if not os.path.isdir(p) and not p.endswith(".json"))
    if not paths:
        raise ConfigError(f"TokenFileDataModule: no token files match {path!r}")
    return paths


class TokenFileDataModule(ParDataModule):
    """Pre-tokenized files (``lightning-par-prepare``), memory-mapped; see the module's docstring."""

    kind = "tokens"

    def __init__(self, path: str | list[str], seq_len: int = 128, val_fraction: float = 0.05,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path, self.seq_len, self.val_fraction = path, seq_len, val_fraction
        if not (isinstance(seq_len, int) and seq_len >= 1) or not 0 <= val_fraction < 1:
            raise ConfigError(f"TokenFileDataModule: seq_len={seq_len} must be >= 1 and val_fraction="
                              f"{val_fraction} in [0, 1)")
        # all checks here, in the launching process: before any rank starts
        self.files = [TokenFile.open(p) for p in token_paths(path)]
        total = sum(f.n_tokens for f in self.files)
        where = self.files[0].path if len(self.files) == 1 else f"{len(self.files)} files matching {path!r}"
        if total == 0:
            raise ConfigError(f"token corpus {where} is empty (0 tokens)")
        self.n_windows = (total - 1) // seq_len
        if self.n_windows == 0:
            raise ConfigError(f"data.seq_len={seq_len} is longer than the token corpus {where} "
                              f"({total} tokens; one sample needs seq_len + 1)")
        # at least one validation window whenever a share is asked for, and at least one to train on
        self.n_val = min(max(int(self.n_windows * val_fraction), 1 if val_fraction > 0 else 0), self.n_windows - 1)
        self.n_tokens = total
        meta = self.files[0].sidecar()
        vocabs = {f.vocab_size for f in self.files if f.vocab_size}
        if len(vocabs) > 1:
            raise ConfigError(f"token files matching {path!r} come from different tokenizers "
                              f"(vocab sizes {sorted(vocabs)})")
        #: ids are < vocab_size (the header's, else the sidecar's; None: unknown) -- for the app to compare
        #: with the model's vocabulary
        self.vocab_size: int | None = vocabs.pop() if vocabs else meta.get("vocab_size")
        #: the id ending every document (from the sidecar; None: unknown)
        self.eos_id: int | None = meta.get("eos_id")
        #: the tokenizer prepare used (from the sidecar; None: unknown), named by the app's vocabulary check
        self.tokenizer_dir: str | None = meta.get("tokenizer")

    def split_sizes(self) -> tuple[int, int]:
        return self.n_windows - self.n_val, self.n_val

    def describe(self) -> str:
        where = self.files[0].path if len(self.files) == 1 else f"{len(self.files)} files matching {self.path!r}"
        return f"token corpus {where}"

    def split_too_small(self, split: str, n: int, global_batch: int) -> str:
        """Names the split, what a sample is, and the setting that sized the split."""
        sample = f"windows of data.seq_len+1={self.seq_len + 1} tokens"
        if split == "validation":
            share = (f"data.val_fraction={self.val_fraction} of its {self.n_windows} {sample}" if self.val_fraction
                     else "data.val_fraction=0: empty")
            return (f"the validation split of {self.describe()} ({share}) has {n} samples, fewer than one global "
                    f"batch of {global_batch}: raise data.val_fraction, lower data.global_batch_size, add data, or "
                    "set trainer.limit_val_batches=0 (no validation)")
        return (f"the training split of {self.describe()} has {n} samples ({sample}), fewer than one global batch "
                f"of {global_batch}: lower data.global_batch_size or data.seq_len, or add data")

    def _build(self) -> tuple[Dataset, Dataset]:
        n_train = self.n_windows - self.n_val
        return (TokenWindows(self.files, self.seq_len, 0, n_train),
                TokenWindows(self.files, self.seq_len, n_train, self.n_val))
