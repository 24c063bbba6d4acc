"""Memory per rank of full, LoRA and QLoRA fine-tuning of one model, side by side, on CPU ranks.

    python benchmarks/bench_lora.py                       # a 4-layer Llama of width 1024 (77.6M parameters), 2 ranks
    python benchmarks/bench_lora.py --hidden 512 --steps 4

One local checkpoint (written here with ``save_pretrained``, a Llama shape: grouped-query attention, SwiGLU MLP,
untied head) is fine-tuned by the app (``lightning-par model=hf_causal_lm model.pretrained=DIR``, one multirun) as a
full fine-tune, with LoRA (rank 16 on the attention and MLP projections) and with QLoRA (the same, base in NF4),
each under ``single`` and ``fsdp`` at 2 ranks, fp32, AdamW. For each run: the model states a rank holds (summary.json:
parameters, gradients, optimizer state, measured before an optimizer step) and the step time (CPU: says little
about a GPU). Ratios are to the full fine-tune of the same strategy. ``--table RUN_DIR`` prints the table of an
earlier run's ``bench_lora.json`` again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAKE = """
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
h, layers, vocab = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = AutoConfig.for_model("llama", hidden_size=h, num_hidden_layers=layers, num_attention_heads=h // 64,
                           num_key_value_heads=max(1, h // 256), intermediate_size=4 * h, vocab_size=vocab,
                           max_position_embeddings=512, tie_word_embeddings=False)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg).save_pretrained(sys.argv[1])
"""
KINDS = {"full": [], "lora": ["model.lora.rank=16"], "qlora": ["model.lora.rank=16", "model.lora.base=nf4"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--table", type=Path, default=None, help="print the table of this earlier --out directory")
    args = p.parse_args()
    if args.table is not None:
        meta = json.loads((args.table / "bench_lora.json").read_text())
        return table(meta["rows"], meta["setup"])
    work = args.out or Path(tempfile.mkdtemp(prefix="bench_lora_"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "base"
    subprocess.run([sys.executable, "-c", MAKE, str(ckpt), str(args.hidden), str(args.layers), str(args.vocab)],
                   check=True, capture_output=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    rows = []
    for kind, overrides in KINDS.items():
        out = work / kind
        cmd = [sys.executable, str(ROOT / "run.py"), "-m", "model=hf_causal_lm", f"model.pretrained={ckpt}",
               "data=synthetic", "data.seq_len=128", "data.global_batch_size=4", f"trainer.max_steps={args.steps}",
               "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "trainer.enable_checkpointing=false",
               "strategy=single,fsdp", "trainer.devices=2", "check_memory=false", *overrides, f"hydra.sweep.dir={out}"]
        done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"bench_lora: {kind} failed:\n{done.stderr[-3000:]}")
        for job in sorted((d for d in out.iterdir() if d.name.isdigit()), key=lambda d: int(d.name)):
            s = json.loads((job / "summary.json").read_text())
            m = s["memory"][0]
            rows.append({"kind": kind, "strategy": s["strategy"], "world": s["world_size"], "params": m["params"],
                         "grads": m["grads"], "optimizer_state": m["optimizer_state"],
                         "step_s": s["step_time_s"], "final_loss": s["final_loss"]})
    n_params = json.loads((work / "full" / "0" / "summary.json").read_text())["n_params"]
    setup = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "steps": args.steps, "n_params": n_params}
    (work / "bench_lora.json").write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))
    table(rows, setup)


def table(rows: list[dict], setup: dict) -> None:
    print(f"Llama shape, hidden {setup['hidden']}, {setup['layers']} layers, vocab {setup['vocab']}: "
          f"{setup['n_params'] / 1e6:.1f}M parameters; fp32, AdamW, 4 x 128 tokens, {setup['steps']} steps; rank 0's figures")
    print(f"{'run':<7}{'strategy':<10}{'params MiB':>11}{'grads MiB':>11}{'optim MiB':>11}{'states MiB':>12}"
          f"{'vs full':>9}{'step s':>8}")
    full = {r["strategy"]: r for r in rows if r["kind"] == "full"}
    for r in rows:
        states = r["params"] + r["grads"] + r["optimizer_state"]
        ref = full[r["strategy"]]
        ratio = states / (ref["params"] + ref["grads"] + ref["optimizer_state"])
        print(f"{r['kind']:<7}{r['strategy']:<10}{r['params'] / 2**20:>11.1f}{r['grads'] / 2**20:>11.1f}"
              f"{r['optimizer_state'] / 2**20:>11.1f}{states / 2**20:>12.1f}{ratio:>9.3f}{r['step_s']:>8.3f}")


if __name__ == "__main__":
    main()
