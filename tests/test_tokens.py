"""Tokenized corpora: ``lightning-par-prepare`` writes token files that ``data=tokens`` memory-maps.

Every asset is made here, offline: a tiny byte-level BPE trained with ``tokenizers`` on generated text
(saved as a transformers tokenizer directory) and small txt / jsonl / parquet / datasets corpora."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_par import ConfigError
from lightning_par.tools import prepare as prep
from lightning_par.data import TokenFileDataModule
from lightning_par.data.tokens import HEADER_BYTES, TokenFile, dtype_for, pack_header

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "token", "window", "shard", "rank", "é", "学习", "🚀"]


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) + rng.choice([".", "!\n", "\n\nok"])
            for _ in range(n)]
    docs[3] = ""  # an empty document is one EOS
    return docs


def save_tokenizer(out: Path, tok, eos: str = "<eos>") -> Path:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(make_docs(300, seed=1), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return save_tokenizer(tmp_path_factory.mktemp("tok") / "bpe", tok)


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)


def write_corpus(kind: str, root: Path, docs: list[str]) -> str:
    """The docs as one input of ``kind``; returns the argument prepare gets."""
    root.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        (root / "c.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
        return str(root / "c.jsonl")
    if kind == "txt":  # one document per file, read in sorted order
        for i, d in enumerate(docs):
            (root / f"{i:04d}.txt").write_text(d)
        return str(root)
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": docs}), root / "c.parquet", row_group_size=7)  # several row groups
        return str(root / "c.parquet")
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": docs})}).save_to_disk(root / "ds")
    return str(root / "ds")


def read_tokens(path: Path) -> np.ndarray:
    f = TokenFile.open(str(path))
    return np.fromfile(path, dtype=f.dtype, offset=HEADER_BYTES)


def run(capsys, *args: str) -> tuple[int, str, str]:
    rc = prep.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("kind", ["jsonl", "txt", "parquet", "datasets"])
def test_prepare_round_trips(kind, tok_dir, hf_tok, tmp_path, capsys):
    docs = make_docs(40)
    src = write_corpus(kind, tmp_path / "in", docs)
    capsys.readouterr()  # datasets' own progress bar while saving
    out = tmp_path / "out.bin"
    rc, stdout, err = run(capsys, src, "--tokenizer", tok_dir, "--out", out, "--workers", 1, "--field", "body")
    assert rc == 0 and err == "" and re.search(r" of text in [\d.]+ s = [\d.,]+ [KMG]?B/s", stdout), (stdout, err)
    assert " 0.0 MB" not in stdout, stdout  # a small corpus in a unit that shows it (was "0.0 MB of text")
    tokens, eos = read_tokens(out), hf_tok.eos_token_id
    assert tokens.dtype == np.uint16 and (tokens == eos).sum() == len(docs) and tokens[-1] == eos
    pieces = np.split(tokens, np.flatnonzero(tokens == eos) + 1)[:-1]
    for doc, piece in zip(docs, pieces):
        ids = piece[:-1].tolist()
        assert ids == hf_tok(doc, add_special_tokens=False)["input_ids"]
        assert hf_tok.backend_tokenizer.decode(ids) == doc
    meta = json.loads(Path(str(out) + ".json").read_text())
    assert meta["vocab_size"] == len(hf_tok) and meta["eos_id"] == eos and meta["n_tokens"] == len(tokens)
    assert meta["n_documents"] == len(docs) and meta["sources"] and sorted(os.listdir(tmp_path)) == [
        "in", "out.bin", "out.bin.json"]
    dm = TokenFileDataModule(str(out), seq_len=8)
    assert dm.vocab_size == len(hf_tok) and dm.eos_id == eos


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_workers_write_the_same_file(tok_dir, tmp_path, capsys):
    src = write_corpus("jsonl", tmp_path / "in", make_docs(400))
    for n in (1, 2):
        rc, _, err = run(capsys, src, "--tokenizer", tok_dir, "--out", tmp_path / f"w{n}.bin", "--workers", n,
                         "--field", "body", "--chunk-mb", 0.002, "--progress")
        assert rc == 0 and "prepare: 100%" in err, err
    assert (tmp_path / "w1.bin").read_bytes() == (tmp_path / "w2.bin").read_bytes()


def test_uint16_until_65536_ids_then_uint32(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert dtype_for(300) == dtype_for(65536) == np.uint16 and dtype_for(65537) == np.uint32
    vocab = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, 70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big = save_tokenizer(tmp_path / "big", tok)
    (tmp_path / "a.txt").write_text("w5 w65535 w65536 w69999")
    rc, _, err = run(capsys, tmp_path / "a.txt", "--tokenizer", big, "--out", tmp_path / "a.bin", "--workers", 1)
    assert rc == 0, err
    assert read_tokens(tmp_path / "a.bin").dtype == np.uint32
    assert read_tokens(tmp_path / "a.bin").tolist() == [5, 65535, 65536, 69999, 0]


def write_tokens(path: Path, tokens: np.ndarray, vocab: int = 1000) -> None:
    with open(path, "wb") as f:
        f.write(pack_header(len(tokens), tokens.dtype, vocab))
        f.write(tokens.tobytes())


def test_dataset_yields_exactly_the_windows_of_the_concatenation(tmp_path):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 1000, n).astype(dt) for n, dt in ((23, np.uint16), (5, np.uint32), (40, np.uint16))]
    for i, p in enumerate(parts):  # three files, two dtypes: windows cross both boundaries
        write_tokens(tmp_path / f"{i}.bin", p)
    every = np.concatenate(parts).astype(np.int64)
    dm = TokenFileDataModule(str(tmp_path / "*.bin"), seq_len=6, val_fraction=0.25)
    dm.setup("fit")
    n = (len(every) - 1) // 6
    assert (len(dm.train_set), len(dm.val_set)) == (n - n // 4, n // 4) and dm.vocab_size == 1000
    windows = [dm.train_set[i] for i in range(len(dm.train_set))] + [dm.val_set[i] for i in range(len(dm.val_set))]
    for i, (x, y) in enumerate(windows):
        assert x.dtype == torch.long and x.tolist() == every[i * 6 : i * 6 + 6].tolist()
        assert y.tolist() == every[i * 6 + 1 : i * 6 + 7].tolist()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_opening_a_gigabyte_reads_only_the_header(tmp_path):
    path, n = tmp_path / "big.bin", 2**29  # 1 GiB of uint16 tokens, sparse: no disk used
    with open(path, "wb") as f:
        f.write(pack_header(n, np.dtype(np.uint16), 50_000))
        f.truncate(HEADER_BYTES + 2 * n)
    before, t0 = rss(), time.perf_counter()
    dm = TokenFileDataModule(str(path), seq_len=1024, global_batch_size=8)
    dm.setup("fit")
    x, _ = dm.val_set[len(dm.val_set) - 1]
    assert time.perf_counter() - t0 < 2 and rss() - before < 64 * 2**20 and x.shape == (1024,)
    assert isinstance(dm.train_set.maps()[0], np.memmap)
    assert len(pickle.dumps(dm.train_set)) < 10_000  # a loader worker maps the file itself, never a copy


def global_batches(dm: TokenFileDataModule, dp: int) -> list[torch.Tensor]:
    """Each step's global batch, rank 0's micro-batch first, from the datamodule's own loaders."""
    per_rank = []
    for r in range(dp):
        dm.dp_coordinates = lambda r=r: (r, dp)
        per_rank.append([x for x, _ in dm.train_dataloader()])
    return [torch.cat([per_rank[r][i] for r in range(dp)]) for i in range(len(per_rank[0]))]


def test_sample_order_does_not_depend_on_the_data_parallel_size(tmp_path):
    write_tokens(tmp_path / "a.bin", np.arange(5000, dtype=np.uint16))
    dm = TokenFileDataModule(str(tmp_path / "a.bin"), seq_len=16, global_batch_size=8, seed=3)
    dm.setup("fit")
    one, two = global_batches(dm, 1), global_batches(dm, 2)
    assert len(one) == len(two) == len(dm.train_set) // 8
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert not torch.equal(one[0][:, 0], torch.arange(8) * 16)  # shuffled


def bad_files(tmp: Path) -> dict[str, tuple[str, str]]:
    """name -> (glob, what the line must say)"""
    write_tokens(tmp / "empty.bin", np.zeros(0, np.uint16))
    (tmp / "junk.bin").write_bytes(b"not a token file at all" * 10)
    write_tokens(tmp / "cut.bin", np.arange(100, dtype=np.uint16))
    with open(tmp / "cut.bin", "r+b") as f:
        f.truncate(HEADER_BYTES + 150)
    write_tokens(tmp / "short.bin", np.arange(10, dtype=np.uint16))
    return {"no match": (str(tmp / "nothing*.bin"), "no token files match"), "empty": ("empty.bin", "empty"),
            "bad header": ("junk.bin", "not a token file"), "truncated": ("cut.bin", "truncated"),
            "seq_len": ("short.bin", "data.seq_len=32 is longer than")}


@pytest.mark.parametrize("case", ["no match", "empty", "bad header", "truncated", "seq_len"])
def test_bad_token_files_are_one_line_naming_the_path(case, tmp_path):
    pattern, words = bad_files(tmp_path)[case]
    pattern = pattern if case == "no match" else str(tmp_path / pattern)
    with pytest.raises(ConfigError) as info:
        TokenFileDataModule(pattern, seq_len=32)  # at construction: before any process starts
    assert words in str(info.value) and pattern.split("*")[0] in str(info.value) and "\n" not in str(info.value)


def test_a_split_that_cannot_fill_a_global_batch_is_one_line_naming_it(tmp_path):
    """``check_splits`` (called by the app's checks before launch): the training split against one global
    batch, and the validation split only when the run validates (``train.validates``)."""
    from tests.helpers import composed
    from lightning_par.run.train import validates

    write_tokens(tmp_path / "c.bin", np.arange(16 * 200 + 1, dtype=np.uint16) % 1000)  # 200 windows of 16
    dm = TokenFileDataModule(str(tmp_path / "c.bin"), seq_len=16, val_fraction=0.05, global_batch_size=16)
    assert dm.split_sizes() == (190, 10)
    dm.check_splits(validating=False)  # 190 training samples fill a batch of 16; validation not asked for
    with pytest.raises(ConfigError) as info:
        dm.check_splits(validating=True)
    line = str(info.value)
    assert line.startswith(f"the validation split of token corpus {tmp_path / 'c.bin'} (data.val_fraction=0.05 of "
                           "its 200 windows of data.seq_len+1=17 tokens) has 10 samples, fewer than one global batch "
                           "of 16: ") and "trainer.limit_val_batches=0" in line and "\n" not in line, line
    big = TokenFileDataModule(str(tmp_path / "c.bin"), seq_len=16, val_fraction=0.05, global_batch_size=256)
    with pytest.raises(ConfigError, match=r"^the training split of token corpus .* has 190 samples \(windows of "
                                          r"data.seq_len\+1=17 tokens\), fewer than one global batch of 256: "):
        big.check_splits(validating=False)
    # whether the run validates, from the trainer's settings (the app's default: every 100 batches of the run)
    assert validates(composed("trainer.max_steps=300"))
    assert not validates(composed("trainer.max_steps=99"))
    assert not validates(composed("trainer.max_steps=49", "trainer.accumulate_grad_batches=2"))  # 98 batches
    assert validates(composed("trainer.max_steps=50", "trainer.accumulate_grad_batches=2"))  # the 100th batch
    assert not validates(composed("trainer.limit_val_batches=0"))
    assert validates(composed("trainer.max_steps=-1", "trainer.max_epochs=1"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_corpus_too_small_for_its_validation_split_stops_before_launch(tmp_path):
    """2 ranks requested; the validation split (10 windows) cannot fill the global batch of 16: one line,
    printed once, exit 2, and no rank started (it used to stop after both ranks were up, each printing
    "10 samples cannot fill one global batch of 16", not saying which split)."""
    from tests.helpers import run_cli

    write_tokens(tmp_path / "c.bin", np.arange(16 * 200 + 1, dtype=np.uint16) % 256, vocab=256)
    proc = run_cli(["model=gpt_tiny", "data=tokens", f"data.path={tmp_path / 'c.bin'}", "data.seq_len=16",
                    "strategy=ddp", "trainer.devices=2", "trainer.max_steps=300", "trainer.enable_progress_bar=false"],
                   tmp_path / "run", timeout=100, check=False)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: the validation split of token corpus {tmp_path / 'c.bin'} "), lines[0]
    assert "has 10 samples, fewer than one global batch of 16" in lines[0], lines[0]
    assert "Initializing distributed" not in proc.stdout + proc.stderr  # before launch
    assert not (tmp_path / "run" / "summary.json").exists()


def test_bad_prepare_input_is_one_line_and_exit_2(tok_dir, tmp_path, capsys):
    good = write_corpus("jsonl", tmp_path / "in", make_docs(5))
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n\n')
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"txt": "no field"}\n')
    (tmp_path / "notdir").write_text("a file")
    (tmp_path / "no_tok").mkdir()
    (tmp_path / "exists.bin").write_text("x")
    out = tmp_path / "out" / "o.bin"
    (tmp_path / "out").mkdir()
    cases = {  # arguments -> words of the line
        (tmp_path / "missing*.jsonl", "--out", out): "does not exist",
        (good, "--out", out, "--tokenizer", tmp_path / "nowhere"): "is not a directory",
        (good, "--out", out, "--tokenizer", tmp_path / "no_tok"): "cannot load a tokenizer",
        (good, "--out", tmp_path / "notdir" / "o.bin"): "cannot write to",
        (good, "--out", tmp_path / "exists.bin"): "exists",
        (tmp_path / "empty.jsonl", "--out", out): "empty corpus",
        (tmp_path / "blank.jsonl", "--out", out): "empty corpus",
        (tmp_path / "broken.jsonl", "--out", out): "without a string field 'text'",
        (tmp_path / "notdir", "--out", out): "unknown kind",
    }
    for args, words in cases.items():
        args = args if "--tokenizer" in args else (*args, "--tokenizer", tok_dir)
        rc, stdout, err = run(capsys, *args, "--workers", 1)
        assert rc == 2 and stdout == "" and err.startswith("error: ") and words in err, (args, err)
        assert err.count("\n") == 1, err
        assert os.listdir(tmp_path / "out") == [], args  # nothing half-written


@pytest.mark.parametrize("failure", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_interrupted_prepare_leaves_no_file(failure, tok_dir, tmp_path, capsys, monkeypatch):
    src = write_corpus("jsonl", tmp_path / "in", make_docs(200))
    calls, real = [], prep._encode_task

    def encode_then_fail(task):
        calls.append(task)
        if len(calls) == 3:
            raise failure
        return real(task)

    monkeypatch.setattr(prep, "_encode_task", encode_then_fail)
    (tmp_path / "out").mkdir()
    args = [src, "--tokenizer", tok_dir, "--out", tmp_path / "out" / "o.bin", "--workers", 1, "--chunk-mb", 0.001,
            "--field", "body"]
    rc, _, err = run(capsys, *args)
    assert "nothing written" in err and err.strip().count("\n") == 0, err
    assert (rc, "disk on fire" in err) == ((130, False) if isinstance(failure, KeyboardInterrupt) else (1, True))
    assert len(calls) == 3 and os.listdir(tmp_path / "out") == []


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(k) for k in f.read().split()]
    except OSError:
        return []


def status(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers in /proc")
@pytest.mark.parametrize("victim", ["worker", "main", "ctrl-c"])
def test_killed_prepare_leaves_no_file_that_looks_complete(victim, tok_dir, tmp_path):
    """SIGKILL a worker (the run fails, removing its files), or the main process mid-run (only the hidden
    temporary file can remain, and it has no valid header), or Ctrl-C (SIGINT to the whole process group:
    one line, exit 130, nothing left)."""
    (tmp_path / "in").mkdir()
    line = json.dumps({"text": " ".join(make_docs(30))}) + "\n"
    # ~64 MB: far more work than the test waits for (only its start is tokenized before the signal), so
    # that a loaded machine -- workers done while the main process waited for a core -- cannot finish it first
    (tmp_path / "in" / "c.jsonl").write_text(line * (64_000_000 // len(line)))
    (tmp_path / "out").mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "lightning_par.tools.prepare", str(tmp_path / "in" / "c.jsonl"),
                             "--tokenizer", str(tok_dir), "--out", str(tmp_path / "out" / "o.bin"), "--workers", "2",
                             "--chunk-mb", "0.05"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, as a shell's job
    deadline, started = time.time() + 60, False
    while time.time() < deadline and not started:  # until the first results are written
        tmps = [p for p in (tmp_path / "out").iterdir() if p.suffix == ".tmp"]
        started = bool(tmps) and tmps[0].stat().st_size > HEADER_BYTES + 10_000
        time.sleep(0.005)
    assert started and proc.poll() is None, "prepare wrote nothing within 60 s, or had already ended"
    helpers = children(proc.pid)  # the fork server (and multiprocessing's resource tracker)
    workers = [w for h in helpers for w in children(h)]
    assert len(workers) == 2, (helpers, workers)
    if victim == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(workers[-1] if victim == "worker" else proc.pid, signal.SIGKILL)
    if victim == "main":  # its orphaned workers see it and end (they hold its stderr: communicate waits on them)
        proc.wait(timeout=10)
    _, err = proc.communicate(timeout=30)
    left = os.listdir(tmp_path / "out")
    assert "o.bin" not in left and "o.bin.json" not in left
    if victim != "main":
        assert proc.returncode == (1 if victim == "worker" else 130) and left == [], err
        assert err.strip().startswith("error: ") and "nothing written" in err and err.strip().count("\n") == 0, err
    else:
        for name in left:
            with pytest.raises(ConfigError, match="not a token file"):
                TokenFile.open(str(tmp_path / "out" / name))
        assert not [p for p in workers if os.path.exists(f"/proc/{p}") and "Z" not in status(p)]
