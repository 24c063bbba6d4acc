"""Benchmark: loading a pretrained checkpoint -- time and per-rank peak resident memory.

Writes a Llama-shaped checkpoint locally (default ~1.2B parameters, fp32, sharded one file per layer
as ``save_pretrained`` writes big models; random values, nothing downloaded), then loads it, each
case in a fresh process (or 2 ranks):

- ``transformers``: ``AutoModelForCausalLM.from_pretrained(DIR)`` in one process, then every
  parameter read once (transformers may return tensors still backed by the file's pages; the
  baseline is a model in memory);
- ``lp_single`` / ``lp_ddp`` / ``lp_fsdp``: a LightningModule calling
  ``lightning_par.models.from_pretrained(DIR)`` in ``configure_model``, through ``Trainer.fit`` with
  ``max_steps=0`` (setup only: build on meta, shard, read each rank's slices).

Per case: wall time of the load (process start excluded: from just before the call to just after)
and every rank's peak RSS (``ru_maxrss``, which counts mapped file pages it touched), against the
full model's bytes, with what the process held before loading (torch, Lightning and transformers
imported) and the growth over it. Under fsdp at 2 ranks the target is a per-rank peak below 0.6x
the model. What the process holds before loading depends on the environment: Lightning imports
torchmetrics, which imports scipy and matplotlib when they are installed (the test extra installs
them), and transformers imports torchao when present; each row names those it found imported. Run
it with the interpreter of the environment to measure, e.g. one made by ``pip install
"lightning_par[hf]"`` (what fine-tuning a checkpoint needs).

    python benchmarks/bench_pretrained_load.py                      # ~1.2B, all cases
    python benchmarks/bench_pretrained_load.py --layers 2 --cases lp_fsdp   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WRITE = textwrap.dedent('''
    import json, sys, torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    out, hidden, layers, inter, vocab = sys.argv[1], *map(int, sys.argv[2:6])
    cfg = AutoConfig.for_model("llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                               num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512),
                               vocab_size=vocab, max_position_embeddings=2048, tie_word_embeddings=False)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(cfg)
    groups = {}
    for name, p in net.named_parameters():
        part = name.split(".")[2] if name.startswith("model.layers.") else "other"
        groups.setdefault(part, []).append((name, tuple(p.shape)))
    g = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, (part, names) in enumerate(groups.items()):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: torch.randn(s, generator=g) * 0.02 for n, s in names}  # one file in memory at a time
        save_file(tensors, f"{out}/{file}", metadata={"format": "pt"})
        weight_map.update({n: file for n in tensors})
        total += sum(t.numel() * 4 for t in tensors.values())
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, open(f"{out}/model.safetensors.index.json", "w"))
    cfg.save_pretrained(out)
    print(total)
''')

LOAD = textwrap.dedent('''
    import json, os, resource, sys, time, warnings, logging
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    case, directory, out = sys.argv[1], sys.argv[2], sys.argv[3]
    def rss_now():  # resident set size now (ru_maxrss is the peak)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    if case == "transformers":
        from transformers import AutoModelForCausalLM
        base = rss_now()
        start = time.perf_counter()
        net = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        # transformers may hand back tensors still backed by the file's mapping, read on first use:
        # touch every parameter once, so the time and memory are those of a model in memory
        sum(float(p.detach().sum()) for p in net.parameters())
        seconds = time.perf_counter() - start
        extras = sorted(m for m in ("scipy", "pandas", "matplotlib", "torchao", "pyarrow") if m in sys.modules)
        json.dump({"seconds": seconds, "rss": [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024],
                   "base": [base], "extras": extras}, open(out, "w"))
        sys.exit(0)
    import lightning as L
    import lightning_par.models
    import lightning_par.strategies

    class FineTune(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = None

        def configure_model(self):
            if self.net is None:
                self.net = lightning_par.models.from_pretrained(directory)

        def training_step(self, batch, batch_idx):
            return self.net(input_ids=batch).logits.mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    # what else the imports pulled in: torchmetrics (imported by Lightning) imports scipy and matplotlib when
    # they are installed, transformers imports torchao; in the test environment they weigh ~0.1 GiB per rank
    extras = sorted(m for m in ("scipy", "pandas", "matplotlib", "torchao", "pyarrow") if m in sys.modules)
    devices = 1 if case == "lp_single" else 2
    trainer = L.Trainer(strategy=case, devices=devices, accelerator="cpu", max_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    base = torch.tensor([rss_now()], dtype=torch.float64)  # imports done: what the process holds before loading
    start = time.perf_counter()
    trainer.fit(FineTune(), torch.utils.data.DataLoader(torch.zeros(4, 8, dtype=torch.long), batch_size=2))
    seconds = time.perf_counter() - start
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
    gathered = trainer.strategy.all_gather(rss).flatten().tolist() if devices > 1 else rss.tolist()
    bases = trainer.strategy.all_gather(base).flatten().tolist() if devices > 1 else base.tolist()
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in trainer.lightning_module.parameters())
    if trainer.is_global_zero:
        json.dump({"seconds": seconds, "rss": gathered, "base": bases, "local_params": local, "extras": extras},
                  open(out, "w"))
''')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--cases", nargs="+", default=["transformers", "lp_single", "lp_ddp", "lp_fsdp"])
    a = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        ckpt.mkdir()
        done = subprocess.run([sys.executable, "-c", WRITE, str(ckpt), str(a.hidden), str(a.layers), str(a.intermediate),
                               str(a.vocab)], env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        model_bytes = int(done.stdout.split()[-1])
        print(f"checkpoint: Llama-shaped, {model_bytes / 4 / 1e9:.2f}B parameters, fp32 {model_bytes / 2**30:.2f} GiB, "
              f"{len(list(ckpt.glob('*.safetensors')))} files; torch threads 1 per process; CPU")
        import importlib.metadata as md
        print("installed: " + ", ".join(f"{d} {md.version(d)}" for d in ("torch", "lightning", "transformers")))
        print(f"{'case':14s} {'ranks':>5s} {'load s':>8s} {'peak RSS per rank (GiB)':>26s} {'max / model':>12s} "
              f"{'before load (GiB)':>18s} {'(peak - before) / model':>24s}")
        script = Path(tmp) / "load.py"  # a file: Lightning's launcher starts the other ranks by re-running it
        script.write_text(LOAD)
        for case in a.cases:
            out = Path(tmp) / f"{case}.json"
            done = subprocess.run([sys.executable, str(script), case, str(ckpt), str(out)], env=env, cwd=tmp,
                                  capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{case} failed:\n{done.stderr[-3000:]}")
            r = json.loads(out.read_text())
            ranks = len(r["rss"])
            per_rank = " ".join(f"{x / 2**30:.2f}" for x in r["rss"])
            grown = max(p - b for p, b in zip(r["rss"], r["base"]))
            print(f"{case:14s} {ranks:5d} {r['seconds']:8.1f} {per_rank:>26s} {max(r['rss']) / model_bytes:12.2f} "
                  f"{max(r['base']) / 2**30:18.2f} {grown / model_bytes:24.2f}  "
                  f"imported beside: {', '.join(r['extras']) or 'none of scipy, pandas, matplotlib, torchao, pyarrow'}")


if __name__ == "__main__":
    main()
