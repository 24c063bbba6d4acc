"""Benchmark: ``lightning-par-prepare``'s throughput against the ``tokenizers`` library's own batch encoding.

Both contestants get the same generated text (Zipf-distributed words, documents of 50..3000 words, as
one ``.jsonl`` file), the same byte-level BPE tokenizer (trained here, offline) and the same number of
workers:

- **library**: ``backend_tokenizer.encode_batch_fast(all documents)`` in one process, its Rust thread
  pool sized to ``--workers`` (``RAYON_NUM_THREADS``); the documents already in memory, ids left as
  Python lists -- the encoding alone, no reading, no writing;
- **prepare**: ``lightning_par.tools.prepare.prepare()`` end to end with ``--workers`` processes: planning,
  starting the workers, reading and parsing the jsonl, encoding, EOS, sending the ids back, writing
  and fsyncing the token file (the clock starts after the tokenizer is loaded, as in the CLI's line).

MB are 10^6 bytes of UTF-8 document text; each figure is the median of ``--reps`` runs, the
contestants interleaved. The ratio is library / prepare (1.0: as fast as the library).

    python benchmarks/bench_prepare.py                 # 2 workers, ~20 MB
    python benchmarks/bench_prepare.py --workers 8 --mb 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np


def make_docs(mb: float, seed: int = 0) -> list[str]:
    """About ``mb`` MB of word salad with a Zipf word distribution (so BPE merges matter, as in prose)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    p = 1 / np.arange(1, 27) ** 0.9
    vocab = ["".join(rng.choice(letters, size=int(rng.integers(1, 11)), p=p / p.sum())) for _ in range(30_000)]
    ranks = 1 / np.arange(1, len(vocab) + 1) ** 1.1
    docs, size = [], 0
    while size < mb * 1e6:
        words = rng.choice(len(vocab), size=int(rng.integers(50, 3000)), p=ranks / ranks.sum())
        text = " ".join(vocab[w] for w in words) + ".\n"
        docs.append(text[0].upper() + text[1:])
        size += len(text.encode())
    return docs


def make_tokenizer(docs: list[str], vocab_size: int, out: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs[: max(1, len(docs) // 10)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--mb", type=float, default=20.0, help="MB of generated text")
    ap.add_argument("--vocab", type=int, default=16_384, help="BPE vocabulary size")
    ap.add_argument("--chunk-mb", type=float, default=1.0, help="prepare's task size")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    # before the library's thread pool first starts (it reads this once)
    os.environ["RAYON_NUM_THREADS"] = str(a.workers)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from transformers import AutoTokenizer

    from lightning_par.tools.prepare import prepare

    with tempfile.TemporaryDirectory() as tmp:
        docs = make_docs(a.mb)
        mb = sum(len(d.encode()) for d in docs) / 1e6
        corpus, tok_dir, out = (os.path.join(tmp, n) for n in ("corpus.jsonl", "tokenizer", "corpus.bin"))
        with open(corpus, "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        make_tokenizer(docs, a.vocab, tok_dir)
        backend = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True).backend_tokenizer
        backend.encode_batch_fast(docs[:8], add_special_tokens=False)  # warm up the thread pool
        lib, ours, n_lib, n_ours = [], [], 0, 0
        for rep in range(a.reps):
            for who in (("lib", "ours") if rep % 2 == 0 else ("ours", "lib")):
                if who == "lib":
                    t0 = time.perf_counter()
                    encs = backend.encode_batch_fast(docs, add_special_tokens=False)
                    lib.append(time.perf_counter() - t0)
                    n_lib = sum(len(e.ids) for e in encs) + len(docs)  # + one EOS each, as prepare writes
                    del encs
                else:
                    meta = prepare([corpus], tok_dir, out, workers=a.workers, chunk_mb=a.chunk_mb, overwrite=True)
                    ours.append(meta["seconds"])
                    n_ours = meta["n_tokens"]
        assert n_lib == n_ours, (n_lib, n_ours)  # the same tokens, or the comparison is void
    t_lib, t_ours = statistics.median(lib), statistics.median(ours)
    print(f"cpus {os.cpu_count()}  workers {a.workers}  text {mb:.1f} MB in {len(docs)} documents  "
          f"BPE vocab {a.vocab}  {n_ours:,} tokens  {a.reps} reps (median)")
    print(f"{'contestant':<44}{'seconds':>9}{'MB/s':>9}")
    print(f"{'tokenizers encode_batch_fast (in memory)':<44}{t_lib:>9.2f}{mb / t_lib:>9.2f}")
    print(f"{'lightning-par-prepare (jsonl -> token file)':<44}{t_ours:>9.2f}{mb / t_ours:>9.2f}")
    print(f"ratio library / prepare throughput = {t_ours / t_lib:.3f}  (target <= 1.3)")


if __name__ == "__main__":
    main()
