"""``data=hf_dataset`` (issue 20, part 3): a ``save_to_disk`` dataset tokenized and packed on the fly.

Cross-checked against the other path to the same data: the windows it yields are exactly those of
``lightning-par-prepare`` + ``data=tokens`` on the same documents and tokenizer; its order does not
depend on the data-parallel size; every bad input is one line naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_par import ConfigError
from lightning_par.data import TokenFileDataModule
from lightning_par.data.hf_dataset import HFDatasetModule
from tests.test_tokens import global_batches, make_docs, run, save_tokenizer, write_corpus


def save_dataset(path: Path, docs: list[str], split: str | None = None) -> str:
    import datasets

    data = datasets.Dataset.from_dict({"body": docs})
    (datasets.DatasetDict({split: data}) if split else data).save_to_disk(str(path))
    return str(path)


def train_tokenizer(out: Path, docs: list[str]) -> Path:
    """A byte-level BPE tokenizer trained on ``docs`` with the tokenizers library, saved for transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return save_tokenizer(out, tok)


def tiny_dataset_and_tokenizer(root: Path) -> tuple[str, str]:
    """A saved dataset (column ``body``) and a BPE tokenizer trained on it, under ``root``."""
    docs = make_docs(200)
    return save_dataset(root / "ds", docs), str(train_tokenizer(root / "tok", docs))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "bpe", make_docs(300, seed=1))


def test_the_windows_equal_prepared_token_files(tok_dir, tmp_path, capsys):
    docs = make_docs(120)
    on_the_fly = HFDatasetModule(save_dataset(tmp_path / "ds", docs), str(tok_dir), field="body", seq_len=16,
                                 global_batch_size=4, val_fraction=0.1)
    rc, _, err = run(capsys, write_corpus("jsonl", tmp_path / "in", docs), "--tokenizer", tok_dir, "--out",
                     tmp_path / "c.bin", "--workers", 1, "--field", "body")
    assert rc == 0, err
    prepared = TokenFileDataModule(str(tmp_path / "c.bin"), seq_len=16, global_batch_size=4, val_fraction=0.1)
    for dm in (on_the_fly, prepared):
        dm.setup("fit")
    assert on_the_fly.vocab_size == prepared.vocab_size and len(on_the_fly.train_set) > 20
    for a, b in ((on_the_fly.train_set, prepared.train_set), (on_the_fly.val_set, prepared.val_set)):
        assert len(a) == len(b) > 0
        for i in range(len(a)):
            assert all(torch.equal(x.long(), y.long()) for x, y in zip(a[i], b[i])), i


def test_order_is_independent_of_the_data_parallel_size(tok_dir, tmp_path):
    dm = HFDatasetModule(save_dataset(tmp_path / "ds", make_docs(200), split="train"), str(tok_dir), field="body",
                         seq_len=8, global_batch_size=8, seed=5)
    dm.setup("fit")
    one, two = global_batches(dm, 1), global_batches(dm, 2)
    assert len(one) == len(two) > 3 and all(torch.equal(a, b) for a, b in zip(one, two))


def test_bad_input_is_one_line(tok_dir, tmp_path):
    good = save_dataset(tmp_path / "ds", make_docs(20), split="train")
    (tmp_path / "empty_dir").mkdir()
    cases = [
        (dict(path=str(tmp_path / "nowhere"), tokenizer=str(tok_dir)), "is not a directory written by save_to_disk"),
        (dict(path=str(tmp_path / "empty_dir"), tokenizer=str(tok_dir)), "cannot be loaded by datasets.load_from_disk"),
        (dict(path=good, tokenizer=str(tok_dir), split="test"), "data.split='test': "),
        (dict(path=good, tokenizer=str(tok_dir), field="text"), "data.field='text': "),
        (dict(path=good, tokenizer=str(tmp_path / "empty_dir")), "data.tokenizer: "),
        # an empty dataset: datasets 5 cannot even load what it saved (one line either way, naming it)
        (dict(path=save_dataset(tmp_path / "none", [], split="train"), tokenizer=str(tok_dir), field="body"),
         f"data.path: {tmp_path / 'none'} "),
    ]
    for kwargs, expected in cases:
        with pytest.raises(ConfigError) as info:
            HFDatasetModule(**{"field": "body", **kwargs})
        assert expected in str(info.value) and len(str(info.value).splitlines()) == 1, (kwargs, str(info.value))
    short = HFDatasetModule(save_dataset(tmp_path / "short", ["a"], split="train"), str(tok_dir), field="body",
                            seq_len=64)
    with pytest.raises(ConfigError, match="fewer than one sample"):
        short.setup("fit")
