"""Benchmark: ZeRO-2 against ZeRO-1 (and DDP), side by side in one sweep: peak memory per rank and step time.

ZeRO-2 reduce-scatters gradients in buckets from backward hooks (``parallel/sharding/zero.py``), so a rank
never holds the full gradients; ZeRO-1 keeps DDP's full gradient buckets. The target: zero2's
measured peak below zero1's, and its step time within 1.1x zero1's. One Hydra multirun trains the
same model under each strategy; the figures are each run's own summary.json: the largest rank's
peak resident set size on CPU (``peak_allocated``, the CUDA allocator's, on GPU) -- next to the
setup's peak, which must be lower for the training peak to be the one compared -- and the median
step time after warm-up.

    python benchmarks/bench_zero2.py                       # gpt2 (124M) at 2 ranks, fp32, on CPU
    python benchmarks/bench_zero2.py --model gpt_small --steps 6
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def sweep(out: Path, a: argparse.Namespace) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "run.py"), "-m", f"model={a.model}", f"strategy={a.strategies}",
           f"trainer.devices={a.devices}", f"data.seq_len={a.seq_len}", f"data.global_batch_size={a.global_batch}",
           f"trainer.max_steps={a.steps}", "trainer.limit_val_batches=0", f"trainer.precision={a.precision}",
           "data.max_bytes=2000000", f"hydra.sweep.dir={out}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=a.timeout)
    if done.returncode != 0:
        raise SystemExit(f"error: the sweep failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    jobs = sorted((p for p in out.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    return [json.loads((p / "summary.json").read_text()) for p in jobs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--strategies", default="zero1,zero2,ddp")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--timeout", type=float, default=3600)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = sweep(Path(tmp) / "sweep", a)
    rows = {}
    for s in runs:
        mem = s["memory"]
        key = "peak_allocated" if mem[0].get("peak_allocated") else "peak_rss"
        setup = "setup_peak_allocated" if key == "peak_allocated" else "setup_peak_rss"
        rows[s["strategy"]] = {"peak": max(m[key] for m in mem), "setup": max(m[setup] for m in mem),
                               "step": s["step_time_s"], "kind": key}
    base = rows.get("zero1")
    print(f"{a.model}, {a.devices} ranks, {a.precision}, seq {a.seq_len}, global batch {a.global_batch}, "
          f"{a.steps} steps; peak = {next(iter(rows.values()))['kind']} of the largest rank")
    print(f"{'strategy':<10} {'peak GiB':>9} {'setup GiB':>10} {'step s':>8} {'peak/zero1':>11} {'step/zero1':>11}")
    for name, r in rows.items():
        ratio = (f"{r['peak'] / base['peak']:>11.2f} {r['step'] / base['step']:>11.2f}" if base else "")
        print(f"{name:<10} {r['peak'] / GIB:>9.2f} {r['setup'] / GIB:>10.2f} {r['step']:>8.3f} {ratio}")
    if base and "zero2" in rows:
        z2 = rows["zero2"]
        ok = z2["peak"] < base["peak"] and z2["step"] <= 1.1 * base["step"]
        print(f"target (zero2 peak < zero1's, step <= 1.1x zero1's): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
