"""Benchmark: the advisor's predicted step time (``costs/step_time.py``) against measured step times.

One run on this machine, side by side: the collectives benchmark measures the link (gloo on CPU,
NCCL on GPU), a one-device run measures the compute rate, then one sweep trains the GPT under each
strategy at ``--devices`` ranks. Each strategy's step time is predicted from those two calibrations
and its run's own ``comm_predicted`` (the comm model, not the measured bytes), and set beside the
measured median step time. The figure that matters is the rank correlation (Spearman's rho over
the strategies): whether the model orders the plans as the machine does. Absolute CPU times are
not the target (on CPU, gloo's collectives and the matmuls share the same cores, so nothing
overlaps as it does on a GPU).

    python benchmarks/bench_step_time.py --devices 2
    python benchmarks/bench_step_time.py --devices 4 --strategies ddp,zero2,fsdp,tensor_parallel,pipeline,fsdp_tp,3d
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rank(values: list[float]) -> list[float]:
    """Ranks 1..n, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = rank(a), rank(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def sweep(out: Path, args: argparse.Namespace, strategies: str, devices: int) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "run.py"), "-m", f"model={args.model}", f"strategy={strategies}",
           f"trainer.devices={devices}", f"data.seq_len={args.seq_len}", f"data.global_batch_size={args.global_batch}",
           f"trainer.max_steps={args.steps}", "trainer.limit_val_batches=0", "trainer.precision=32-true",
           "data.max_bytes=2000000", "+model.n_head=4", f"+model.n_embd={args.hidden}", f"+model.n_layer={args.layers}",
           f"hydra.sweep.dir={out}"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=args.timeout)
    jobs = sorted((p for p in out.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    return [json.loads((p / "summary.json").read_text()) for p in jobs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--strategies", default="ddp,zero1,zero2,zero3,fsdp,tensor_parallel,pipeline")
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--hidden", type=int, default=256, help="the preset's width, overridden (default %(default)s)")
    ap.add_argument("--layers", type=int, default=4, help="the preset's depth, overridden (default %(default)s)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()

    from lightning_par.tools.collectives import run as collectives
    from lightning_par.costs.activations import Shape
    from lightning_par.costs.step_time import Device, flops_per_token, step_time
    from lightning_par.models.gpt import PRESETS, GPTConfig
    from lightning_par.strategies.catalog import entry

    # the link: bus bandwidth of the largest buffer, and the latency of the smallest
    import torch

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    rows = collectives(args.devices, backend, ["all_reduce", "all_gather", "reduce_scatter"], [1 << 10, 16 << 20],
                       iters=5, warmup=1, timeout=300)
    busbw = statistics.median(r["busbw_gbs"] for r in rows if r["size"] == 16 << 20)
    latency_us = statistics.median(r["time_us"] for r in rows if r["size"] == 1 << 10)
    cfg = GPTConfig(**{**PRESETS[args.model], "n_head": 4, "n_embd": args.hidden, "n_layer": args.layers})
    shape = Shape.of(cfg, args.seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        (single,) = sweep(Path(tmp) / "single", args, "single", 1)
        runs = sweep(Path(tmp) / "many", args, args.strategies, args.devices)
    # the compute rate: the one-device run's model FLOPs per second, shared by the ranks of one machine
    rate = flops_per_token(shape) * args.seq_len * args.global_batch / single["step_time_s"]
    # on a CPU with gloo nothing overlaps (the collectives take the matmuls' cores): overlap 0
    device = Device(peak_tflops=rate / args.devices / 1e12, efficiency=1.0, latency_us=latency_us,
                    overlap=0.0 if backend == "gloo" else 1.0)
    print(f"model {args.model} (width {args.hidden}, {args.layers} layers, seq {args.seq_len}, "
          f"global batch {args.global_batch}, fp32), {args.devices} ranks; "
          f"calibration: {rate / 1e9:.1f} GFLOP/s on one device, {busbw:.2f} GB/s bus bandwidth, "
          f"{latency_us:.0f} us per small collective")
    print(f"{'strategy':<18}{'measured s':>12}{'predicted s':>13}{'ratio':>8}")
    measured, predicted = [], []
    for s in runs:
        mesh = {k: v for k, v in s["mesh"].items() if v > 1}
        pp = mesh.get("pp", 1)
        t = step_time(shape, traffic=entry(s["strategy"]).comm, mesh=mesh, global_batch=args.global_batch,
                      comm=s["comm_predicted"] or {}, bandwidth_gbs={"default": busbw}, device=device,
                      compute_bytes=2, micro_batches=pp if pp > 1 else 1)
        measured.append(s["step_time_s"])
        predicted.append(t.total)
        print(f"{s['strategy']:<18}{s['step_time_s']:>12.4f}{t.total:>13.4f}{t.total / s['step_time_s']:>8.2f}")
    print(f"Spearman rank correlation (predicted vs measured, {len(runs)} strategies): "
          f"{spearman(predicted, measured):.2f}")


if __name__ == "__main__":
    main()
