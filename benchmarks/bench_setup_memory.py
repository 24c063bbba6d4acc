"""Benchmark: what a rank holds at the end of setup, before the first step (deferred initialisation).

Every lightning_par strategy builds the model on the meta device, applies its techniques there,
and materialises only the rank's own part. This measures each rank's peak resident memory at the
end of setup (``memory[].setup_peak_rss`` in summary.json) for a GPT of about 0.8B parameters
(``model=gpt2_large``, 774M, 3.1 GB in fp32) at 2 ranks on this machine's CPU:

- ``baseline``: the same run with the tiny GPT: the process itself (Python, torch, Lightning,
  gloo, data) with no model to speak of;
- ``zero3``: each rank should hold its half of the parameters plus at most one init group's full
  tensors at a time (the largest: the 50304 x 1280 embedding, 0.26 GB);
- ``ddp``: each rank holds the whole model (data parallelism replicates it), for comparison.

The target: zero3's setup peak < 0.6 x full fp32 model bytes + baseline, on every rank. zero3 runs
one training step (it must reach it); ddp and the baseline stop at setup (``trainer.max_steps=0``:
ddp's full optimizer state would not fit two ranks on a 24 GB machine, and the step is not what is
measured).

    python benchmarks/bench_setup_memory.py            # about 2-3 minutes on 2 CPU cores
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
COMMON = ["data=synthetic", "data.seq_len=32", "data.global_batch_size=2", "data.n_samples=64",
          "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "logger=csv", "trainer.devices=2"]


def run(args: list[str], out: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "run.py"), *COMMON, *args, f"hydra.run.dir={out}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(args)}\n{proc.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2_large")
    a = parser.parse_args()
    gib = 1024 ** 3
    with tempfile.TemporaryDirectory() as tmp:
        base = run(["strategy=zero3", "model=gpt_tiny", "trainer.max_steps=0"], Path(tmp, "base"))
        zero3 = run(["strategy=zero3", f"model={a.model}", "trainer.max_steps=1"], Path(tmp, "zero3"))
        ddp = run(["strategy=ddp", f"model={a.model}", "trainer.max_steps=0"], Path(tmp, "ddp"))
    full = zero3["n_params"] * 4
    print(f"model {a.model}: {zero3['n_params'] / 1e6:.0f}M parameters, full fp32 model {full / gib:.2f} GiB; "
          f"zero3 ran {zero3['steps']} step(s), loss {zero3['final_loss']:.3f}")
    print(f"{'run':<10}{'rank':>5}{'setup peak RSS':>17}{'minus baseline':>16}{'/ full model':>14}")
    ok = True
    for name, summary in (("baseline", base), ("zero3", zero3), ("ddp", ddp)):
        for rank, m in enumerate(summary["memory"]):
            baseline = base["memory"][rank]["setup_peak_rss"]
            extra = m["setup_peak_rss"] - baseline
            print(f"{name:<10}{rank:>5}{m['setup_peak_rss'] / gib:>13.2f} GiB{extra / gib:>12.2f} GiB"
                  f"{extra / full:>14.2f}")
            if name == "zero3":
                ok &= m["setup_peak_rss"] < 0.6 * full + baseline
    print(f"target zero3 setup peak < 0.6 x full + baseline on every rank: {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
