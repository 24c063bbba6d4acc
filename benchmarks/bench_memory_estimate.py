"""Benchmark: the estimator's predicted per-rank peak against the CUDA allocator's measured peak.

For each preset x strategy x checkpointing, two runs of the app: ``mode=estimate`` (estimate.json:
the strategy's row, ``peak``) and a short training run (summary.json: ``memory[].peak_allocated``,
the largest rank, read before teardown by the memory callback). Prints one row each with the ratio
estimate / measured and the device name. Needs a GPU (``torch.cuda.max_memory_allocated``); on CPU
the cross-check is ``tests/test_activation_memory.py`` (torch's MemTracker) and this script exits 2.

    python benchmarks/bench_memory_estimate.py                                  # gpt2, gpt2_medium, gpt2_xl
    python benchmarks/bench_memory_estimate.py --presets gpt2 --strategies single fsdp --devices 2
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


def run(args: list[str], out: Path) -> None:
    done = subprocess.run([sys.executable, "run.py", *args, f"paths.output_dir={out}"], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def one(preset: str, strategy: str, ckpt: bool, a: argparse.Namespace, tmp: Path) -> tuple[int, int]:
    devices = 1 if strategy == "single" else a.devices
    common = [f"model={preset}", f"strategy={strategy}", f"trainer.devices={devices}",
              f"trainer.precision={a.precision}", "data=synthetic" if a.synthetic else "data=text",
              f"data.seq_len={a.seq_len}", f"data.global_batch_size={a.batch * devices}",
              f"strategy.activation_checkpointing={str(ckpt).lower()}"]
    est_dir, run_dir = tmp / f"{preset}-{strategy}-{ckpt}-est", tmp / f"{preset}-{strategy}-{ckpt}-run"
    run(["mode=estimate", *common], est_dir)
    run([*common, f"trainer.max_steps={a.steps}", "trainer.limit_val_batches=0"], run_dir)
    rows = json.loads((est_dir / "estimate.json").read_text())["strategies"]
    predicted = next(r["peak"] for r in rows if r["strategy"] == strategy)
    measured = max(int(m["peak_allocated"]) for m in json.loads((run_dir / "summary.json").read_text())["memory"])
    return predicted, measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["gpt2", "gpt2_medium", "gpt2_xl"])
    ap.add_argument("--strategies", nargs="+", default=["single", "fsdp"])
    ap.add_argument("--devices", type=int, default=max(1, torch.cuda.device_count()), help="ranks for fsdp")
    ap.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--synthetic", action="store_true", help="synthetic tokens instead of the text corpus")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a GPU (the allocator's peak); on CPU see tests/test_activation_memory.py", file=sys.stderr)
        sys.exit(2)
    print(f"device: {torch.cuda.get_device_name(0)}, {a.precision}, micro-batch {a.batch} x {a.seq_len}")
    print(f"{'preset':<12}{'strategy':<10}{'ckpt':<6}{'estimate GiB':>14}{'measured GiB':>14}{'ratio':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for preset in a.presets:
            for strategy in a.strategies:
                for ckpt in (False, True):
                    est, got = one(preset, strategy, ckpt, a, Path(tmp))
                    print(f"{preset:<12}{strategy:<10}{str(ckpt):<6}{est / 2**30:>14.2f}{got / 2**30:>14.2f}"
                          f"{est / got:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
