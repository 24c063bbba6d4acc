"""Benchmark: what CPU offload costs and saves -- ``zero3`` against ``zero3_offload`` side by side.

Both runs go through the app (``python run.py``) with the same model, data, batch, precision and
steps on one process; only the strategy differs. From each run's summary.json it prints the step
time, the device allocator's peak (on CUDA), the process's peak RSS and the bytes the memory
callback counted as offloaded, and the ratios offload / resident. On a GPU the interesting figure
is how much device memory offload frees and what it costs in step time; on CPU both live in the
same memory, so only the time column means anything.

    python benchmarks/bench_offload.py                                   # gpt2_medium on CUDA, gpt_small on CPU
    python benchmarks/bench_offload.py --preset gpt2_large --batch 4 --steps 12
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def run_app(strategy: str, a: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "run.py", f"strategy={strategy}", f"model={a.preset}", "trainer.devices=1",
           f"trainer.precision={a.precision}", "data=synthetic", f"data.seq_len={a.seq_len}",
           f"data.global_batch_size={a.batch}", f"data.n_samples={max(512, a.batch * (a.steps + 4))}",
           f"trainer.max_steps={a.steps}", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
           f"callbacks.throughput.warmup_steps={a.warmup}", f"paths.output_dir={out}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[2:])} failed:\n{done.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    ap.add_argument("--preset", default="gpt2_medium" if cuda else "gpt_small")
    ap.add_argument("--batch", type=int, default=8 if cuda else 8)
    ap.add_argument("--seq-len", type=int, default=1024 if cuda else 128)
    ap.add_argument("--precision", default="bf16-mixed" if cuda else "32-true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--strategies", nargs="+", default=["zero3", "zero3_offload"])
    a = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for s in a.strategies:
            rows[s] = run_app(s, a, Path(tmp) / s)
    dev = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"device {dev}  torch {torch.__version__}  model {a.preset}  batch {a.batch} x {a.seq_len}  "
          f"{a.precision}  {a.steps} steps (warm-up {a.warmup})")
    print(f"{'strategy':<16}{'step ms':>10}{'tokens/s':>11}{'dev peak GiB':>14}{'peak RSS GiB':>14}{'offloaded GiB':>15}")
    def gib(x):
        return f"{x / 2**30:.2f}" if x else "-"
    for s, summ in rows.items():
        mem = summ["memory"][0]
        t = summ["step_time_s"]
        print(f"{s:<16}{1000 * t:>10.1f}{a.batch * a.seq_len / t:>11.0f}{gib(mem.get('peak_allocated')):>14}"
              f"{gib(mem.get('peak_rss')):>14}{gib(mem.get('offloaded')):>15}")
    base, off = rows[a.strategies[0]], rows[a.strategies[-1]]
    print(f"ratio step time {a.strategies[-1]} / {a.strategies[0]} = {off['step_time_s'] / base['step_time_s']:.3f}")
    if cuda and base["memory"][0].get("peak_allocated"):
        print(f"ratio device peak {a.strategies[-1]} / {a.strategies[0]} = "
              f"{off['memory'][0]['peak_allocated'] / base['memory'][0]['peak_allocated']:.3f}")


if __name__ == "__main__":
    main()
