"""``python -m lightning_par.tools.tiny_checkpoint DIR``: a tiny causal LM checkpoint and its tokenizer, made
here, without a download -- for trying the fine-tuning recipes (README: "Fine-tune a pretrained checkpoint",
"Recipes") before bringing a real checkpoint.

``DIR`` is what ``save_pretrained`` writes for a model and its tokenizer: ``config.json``,
``generation_config.json``, ``model.safetensors`` and the tokenizer files. The tokenizer is a byte-level
BPE (320 ids: the 256 bytes, ``<unk>``, ``<s>``, ``</s>`` and merges) trained with the ``tokenizers``
library on a small generated corpus of English-like words; ``--corpus FILE.jsonl`` also writes that corpus
(one ``{"text": ...}`` document a line: ``lightning-par-prepare``'s input). The model (``--arch``: a Llama
with grouped-query attention and an untied head, or a GPT-2 with tied embeddings, ...) has 4 layers of
width 64, 128 positions and a vocabulary of 320 (>= 256: the app's default byte-level text data fits
too), randomly initialised from ``--seed``: the same files every time. Needs ``pip install "lightning_par[hf]"``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

WORDS = ("data", "parallel", "shard", "gradient", "rank", "pipeline", "tensor", "expert", "model", "step",
         "loss", "memory", "token", "layer", "the", "a", "of", "and", "to", "is")
#: per architecture: the transformers config fields beside the common sizes
ARCHS = {
    "llama": dict(num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False),
    "qwen2": dict(num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False),
    "mistral": dict(num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False),
    "gpt2": dict(n_inner=128, tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


def documents(n: int = 400, seed: int = 0) -> list[str]:
    """``n`` documents of 20-60 words from ``WORDS``, each ending with a full stop (seeded)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) + "." for _ in range(n)]


def tiny_checkpoint(out: str | Path, arch: str = "llama", *, corpus: str | Path | None = None, seed: int = 0) -> Path:
    """Write the tiny ``arch`` model and its tokenizer to ``out`` (and the corpus to ``corpus``); returns ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    if arch not in ARCHS:
        raise ValueError(f"unknown --arch {arch!r}; choose from: {', '.join(ARCHS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not empty; name a new directory")
    docs = documents(seed=seed)
    if corpus is not None:
        Path(corpus).parent.mkdir(parents=True, exist_ok=True)
        Path(corpus).write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(seed)
    AutoConfig.for_model(arch).save_pretrained(out)  # so the tokenizer loads as the model type's class does
    fast.save_pretrained(str(out))
    loaded = AutoTokenizer.from_pretrained(str(out))
    cfg = AutoConfig.for_model(arch, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                               vocab_size=-(-len(loaded) // 64) * 64,  # padded, as real checkpoints are
                               max_position_embeddings=128, bos_token_id=loaded.bos_token_id,
                               eos_token_id=loaded.eos_token_id, **ARCHS[arch])
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lightning_par.tools.tiny_checkpoint",
                                 description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    ap.add_argument("out", help="the directory to write (new, or empty)")
    ap.add_argument("--arch", default="llama", choices=sorted(ARCHS), help="the architecture (default llama)")
    ap.add_argument("--corpus", default=None, help="also write the tokenizer's training text here, as jsonl")
    ap.add_argument("--seed", type=int, default=0, help="the weights' and the corpus' seed (default 0)")
    a = ap.parse_args(argv)
    from lightning_par.core.jobs import quiet_third_party_logs

    quiet_third_party_logs()  # the first screen is ours, not import noise
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        out = tiny_checkpoint(a.out, a.arch, corpus=a.corpus, seed=a.seed)
    except ImportError as e:
        print(f"error: {e.name or e} is missing: pip install 'lightning_par[hf]'", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out}: a tiny {a.arch} ({n / 1e6:.1f} MB) and its tokenizer"
          + (f"; its training text as {a.corpus}" if a.corpus else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
