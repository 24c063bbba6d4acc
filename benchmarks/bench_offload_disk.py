"""Benchmark: host memory of the disk tier -- no offload, CPU offload and disk offload side by side.

Three runs through the app (``python run.py``), one process each, the same model, data, batch,
precision and steps: ``zero3`` (no offload), ``zero3_offload`` (parameters, gradients and optimizer
state in host memory) and ``zero3_offload strategy.offload_dir=DIR`` (the same in files at DIR,
``parallel/sharding/disk_offload.py``). From each run's summary.json: the step time, the process's peak RSS
(``VmHWM``: anonymous and file-backed pages mapped, over setup and training), the bytes in the disk
tier's files, the losses (the disk tier must give the CPU offload run's), and the ratio of the disk
tier's peak RSS to CPU offload's (target: at most 0.25 for gpt2_large).

    python benchmarks/bench_offload_disk.py --offload-dir /var/tmp/lp_disk            # gpt2_large, 3 steps
    python benchmarks/bench_offload_disk.py --preset gpt2 --steps 4 --offload-dir /var/tmp/lp_disk
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = {"none": ["strategy=zero3"], "cpu offload": ["strategy=zero3_offload"], "disk offload": None}


def run_app(extra: list[str], a: argparse.Namespace, out: Path) -> tuple[dict, float]:
    cmd = [sys.executable, "run.py", *extra, f"model={a.preset}", "trainer.devices=1",
           f"trainer.precision={a.precision}", "data=synthetic", f"data.seq_len={a.seq_len}",
           f"data.global_batch_size={a.batch}", f"data.n_samples={max(64, a.batch * (a.steps + 4))}",
           f"trainer.max_steps={a.steps}", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
           f"callbacks.throughput.warmup_steps={a.warmup}", "check_memory=false", f"paths.output_dir={out}"]
    # every row with the allocation threshold the disk tier sets for itself (disk_offload.fix_mmap_threshold):
    # freed temporaries go back to the OS in all three, so the rows differ only by where the states live
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(256 * 2**10)}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[2:])} failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text()), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2_large")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--offload-dir", default=None, help="the disk tier's directory (default: a temporary one)")
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    a = ap.parse_args()
    rows: dict[str, tuple[dict, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        offload_dir = a.offload_dir or str(Path(tmp) / "offload")
        for name in a.rows:
            extra = ROWS[name] or ["strategy=zero3_offload", f"strategy.offload_dir={offload_dir}"]
            rows[name] = run_app(extra, a, Path(tmp) / name.replace(" ", "_"))
            print(f"# {name}: done", file=sys.stderr, flush=True)
    summ0 = next(iter(rows.values()))[0]
    print(f"CPU ({os.cpu_count()} cores)  model {a.preset} ({summ0['n_params'] / 1e6:.0f}M params)  batch {a.batch} x "
          f"{a.seq_len}  {a.precision}  {a.steps} steps, one rank  offload_dir {a.offload_dir or '(temporary)'}")
    print(f"| offload | peak RSS GiB | setup peak RSS GiB | step s | run wall s | final loss |")
    print("|---|---|---|---|---|---|")
    for name, (summ, wall) in rows.items():
        mem = summ["memory"][0]
        print(f"| {name} | {mem['peak_rss'] / 2**30:.2f} | {mem['setup_peak_rss'] / 2**30:.2f} | "
              f"{summ['step_time_s']:.2f} | {wall:.0f} | {summ['final_loss']:.6f} |")
    if "cpu offload" in rows and "disk offload" in rows:
        cpu, disk = rows["cpu offload"][0], rows["disk offload"][0]
        ratio = disk["memory"][0]["peak_rss"] / cpu["memory"][0]["peak_rss"]
        same = cpu["losses"] == disk["losses"]
        print(f"ratio peak RSS disk / cpu offload = {ratio:.3f} (target <= 0.25: {'met' if ratio <= 0.25 else 'missed'}); "
              f"losses equal: {same}; step time disk / cpu offload = {disk['step_time_s'] / cpu['step_time_s']:.2f}")


if __name__ == "__main__":
    main()
