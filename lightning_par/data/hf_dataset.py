"""``data=hf_dataset``: a ``datasets`` dataset saved with ``save_to_disk``, tokenized and packed on the fly.

For small sets, where preparing a token file (``lightning-par-prepare``, ``data=tokens``) is not
worth a step: every process loads the dataset from disk (``datasets.load_from_disk``, memory-mapped
Arrow), tokenizes the ``field`` column with a local tokenizer in batches, appends the tokenizer's EOS
to every document and packs the result into one token stream cut into windows exactly as
``data=tokens`` does (stride ``seq_len``, the last ``val_fraction`` validation). The stream is a
function of the dataset and the tokenizer only, so every rank builds the same one and the order stays
independent of the data-parallel size (``ParDataModule``'s sampler). Everything is checked at
construction, one line naming the path: the directory, the split, the column, the tokenizer, an
empty corpus.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_par import ConfigError
from lightning_par.data.datamodules import ParDataModule, WindowDataset


class HFDatasetModule(ParDataModule):
    """Token windows of a ``save_to_disk`` dataset's text column.

    Args:
        path: the directory ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` wrote.
        tokenizer: a local tokenizer directory (``AutoTokenizer.from_pretrained``).
        field: the text column.
        split: a ``DatasetDict``'s split (null: ``train``).
        seq_len, val_fraction: as ``data=tokens``.
        batch_docs: documents tokenized per call.
    """

    kind = "tokens"

    def __init__(self, path: str, tokenizer: str, field: str = "text", split: str | None = None, seq_len: int = 128,
                 val_fraction: float = 0.05, batch_docs: int = 1000, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path, self.tokenizer_dir, self.field, self.split = os.path.expanduser(str(path)), str(tokenizer), field, split
        self.seq_len, self.val_fraction, self.batch_docs = seq_len, val_fraction, batch_docs
        self._tokenizer = _load_tokenizer(self.tokenizer_dir)
        self.vocab_size = len(self._tokenizer)  # for the app's check against the model's vocabulary
        self.eos_id = self._tokenizer.eos_token_id
        if self.eos_id is None:
            raise ConfigError(f"data.tokenizer: {self.tokenizer_dir} has no EOS token to separate documents")
        rows = len(self._dataset())  # opens it here, in the launching process: before any rank starts
        if rows == 0:
            raise ConfigError(f"data.path: {self.path} holds no rows")

    def _dataset(self) -> Any:
        try:
            import datasets
        except ImportError:
            raise ConfigError("data=hf_dataset needs the datasets package: pip install 'lightning_par[data]'") from None
        if not os.path.isdir(self.path):
            raise ConfigError(f"data.path: {self.path} is not a directory written by save_to_disk")
        try:
            data = datasets.load_from_disk(self.path)
        except Exception as e:  # noqa: BLE001 - datasets raises several types for a directory it cannot read
            raise ConfigError(f"data.path: {self.path} cannot be loaded by datasets.load_from_disk "
                              f"({' '.join(str(e).split())[:200]})") from None
        if isinstance(data, datasets.DatasetDict):
            split = self.split or "train"
            if split not in data:
                raise ConfigError(f"data.split={split!r}: {self.path} has splits {', '.join(data)}")
            data = data[split]
        if self.field not in data.column_names:
            raise ConfigError(f"data.field={self.field!r}: {self.path} has columns {', '.join(data.column_names)}")
        return data

    def read_tokens(self) -> torch.Tensor:
        """The packed token stream: every document's ids, then EOS."""
        data, ids = self._dataset(), []
        for start in range(0, len(data), self.batch_docs):
            texts = data[start:start + self.batch_docs][self.field]
            for doc in self._tokenizer(texts, add_special_tokens=False)["input_ids"]:
                ids.extend(doc)
                ids.append(self.eos_id)
        if len(ids) < self.seq_len + 1:
            raise ConfigError(f"data.path: {self.path} tokenizes to {len(ids)} tokens, fewer than one sample "
                              f"of seq_len + 1 = {self.seq_len + 1}")
        return torch.tensor(ids, dtype=torch.int32 if self.vocab_size > 2**15 else torch.int16)

    def _build(self) -> tuple[Dataset, Dataset]:
        tokens = self.read_tokens()
        windows = (len(tokens) - 1) // self.seq_len
        n_val = min(max(1, int(windows * self.val_fraction)), windows - 1) if self.val_fraction > 0 else 0
        if windows - n_val < 1 or (self.val_fraction > 0 and n_val < 1):
            raise ConfigError(f"data.path: {self.path} gives {windows} window(s) of seq_len={self.seq_len}: too few "
                              "for a training and a validation set; lower data.seq_len or add data")
        cut = (windows - n_val) * self.seq_len
        return WindowDataset(tokens[: cut + 1], self.seq_len), WindowDataset(tokens[cut:], self.seq_len)


def _load_tokenizer(directory: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("data=hf_dataset needs transformers: pip install 'lightning_par[hf]'") from None
    try:
        return AutoTokenizer.from_pretrained(os.path.expanduser(directory), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises several types for a bad directory
        raise ConfigError(f"data.tokenizer: {directory} cannot be loaded ({' '.join(str(e).split())[:200]})") from None
