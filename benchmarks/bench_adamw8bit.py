"""Benchmark: the loss curve of AdamW against torchao's 8-bit AdamW (``model.optimizer=adamw8bit``).

Two runs of the same job through the app (``python run.py``), differing only in the optimizer:
same model, data, seed and steps. Prints the final loss of each (and the mean of the last 20
steps, less noisy than one step), each run's optimizer-state bytes as the memory callback counted
them, and writes the two per-step loss curves into one plot.

    python benchmarks/bench_adamw8bit.py                      # 300 steps of experiment=quick (CPU-sized)
    python benchmarks/bench_adamw8bit.py --job "model=gpt_small" --steps 300   # the app's default job

The default job on a 2-core CPU is ``experiment=quick`` (gpt_tiny, 0.14M parameters, byte-level
stdlib text, seq 64, global batch 8); ``--job`` takes any other overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(job: list[str], optimizer: str, steps: int, out: str) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "run.py"), *job, f"model.optimizer={optimizer}",
           f"trainer.max_steps={steps}", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
           f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: {optimizer} run failed:\n{proc.stderr[-2000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", default="experiment=quick", help="overrides of the job (one string)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "adamw8bit_loss.png"))
    args = ap.parse_args()
    job = shlex.split(args.job)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_adamw8bit_") as tmp:
        for opt in ("adamw", "adamw8bit"):
            results[opt] = run(job, opt, args.steps, os.path.join(tmp, opt))
    print(f"job: {' '.join(job)}, {args.steps} steps, model {results['adamw']['model']} "
          f"({results['adamw']['n_params']} parameters)")
    print(f"{'optimizer':<10} {'final loss':>10} {'mean last 20':>13} {'optim state/rank':>17} {'step ms':>8}")
    for opt, s in results.items():
        losses = s["losses"]
        tail = sum(losses[-20:]) / len(losses[-20:])
        state = s["memory"][0]["optimizer_state"]
        step = (s.get("step_time_s") or 0) * 1e3
        print(f"{opt:<10} {losses[-1]:>10.4f} {tail:>13.4f} {state / 1024:>13.1f} KiB {step:>8.1f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for opt, s in results.items():
        ax.plot(range(1, len(s["losses"]) + 1), s["losses"], label=f"{opt} (final {s['losses'][-1]:.3f})", lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(f"AdamW vs torchao AdamW8bit: {' '.join(job)}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {os.path.relpath(args.plot, ROOT)}")


if __name__ == "__main__":
    main()
