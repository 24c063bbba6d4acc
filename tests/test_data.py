"""The data order does not depend on the data-parallel size; the global batch is the user's knob."""

from __future__ import annotations

import pytest
import torch

from lightning_par import ConfigError
from lightning_par.data import DataParallelSampler, SyntheticImages, SyntheticVectors, TextDataModule, micro_batch_size


def rank_batches(n: int, global_batch: int, dp: int, accumulate: int = 1, seed: int = 0) -> list[list[list[int]]]:
    """batches[rank][k] for every rank (k counts micro-batches)."""
    micro = micro_batch_size(global_batch, dp, accumulate)
    out = []
    for r in range(dp):
        idx = list(DataParallelSampler(n, micro_batch=micro, dp_rank=r, dp_size=dp, accumulate=accumulate, seed=seed))
        out.append([idx[i : i + micro] for i in range(0, len(idx), micro)])
    return out


@pytest.mark.parametrize("dp,accumulate", [(2, 1), (4, 1), (2, 2), (8, 1), (4, 2)])
def test_union_of_rank_batches_is_the_single_device_batch(dp, accumulate):
    n, gb = 203, 16
    single = rank_batches(n, gb, 1)[0]  # one micro-batch = one global batch
    per_rank = rank_batches(n, gb, dp, accumulate)
    steps = len(single)
    assert all(len(b) == steps * accumulate for b in per_rank)
    for i in range(steps):
        union = sorted(x for r in range(dp) for k in range(accumulate) for x in per_rank[r][i * accumulate + k])
        assert union == sorted(single[i])


def test_epochs_reshuffle_and_cover_without_repeats():
    s = DataParallelSampler(100, micro_batch=10, seed=3)
    first = list(s)
    s.set_epoch(1)
    second = list(s)
    assert sorted(first) == sorted(second) == list(range(100)) and first != second


@pytest.mark.parametrize("gb,dp,acc", [(7, 2, 1), (8, 3, 1), (8, 2, 3), (0, 1, 1)])
def test_indivisible_global_batch_is_a_config_error(gb, dp, acc):
    with pytest.raises(ConfigError, match="not divisible"):
        micro_batch_size(gb, dp, acc)


def test_text_corpus_is_stdlib_bytes_and_next_token_targets():
    dm = TextDataModule(seq_len=32, max_bytes=50_000, global_batch_size=4)
    dm.setup("fit")
    x, y = dm.train_set[3]
    assert x.dtype == torch.long and x.shape == y.shape == (32,)
    assert torch.equal(x[1:], y[:-1])  # targets are the inputs shifted by one byte
    assert int(x.max()) < 256


def test_text_files_glob_error(tmp_path):
    with pytest.raises(ConfigError, match="no files match"):  # at construction: before processes start
        TextDataModule(files=str(tmp_path / "nothing*.txt")).setup("fit")


def test_own_text_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 100)
    dm = TextDataModule(files=str(tmp_path / "*.txt"), seq_len=16, val_fraction=0.1)
    dm.setup("fit")
    assert bytes(dm.train_set[0][0].tolist()).decode().startswith("hello world")


@pytest.mark.parametrize("cls", [SyntheticVectors, SyntheticImages])
def test_synthetic_classification_is_deterministic(cls):
    a, b = cls(n_samples=64), cls(n_samples=64)
    a.setup(), b.setup()
    assert torch.equal(a.train_set[5][0], b.train_set[5][0]) and a.train_set[5][1] == b.train_set[5][1]
