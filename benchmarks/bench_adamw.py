"""Benchmark: torch's AdamW implementations on a GPT preset's parameters -- fused, foreach, for-loop.

lightning_par asks for ``fused=True`` when every parameter is a CUDA tensor and ``foreach=True``
otherwise (``lightning_par/core/optim.py``); this measures what that choice is worth. One process, the
same parameters and gradients for every contestant, contestants interleaved over ``--reps``; the
figure is the median time of one ``optimizer.step()`` (device synchronised around each step).

    python benchmarks/bench_adamw.py                      # gpt2 on CUDA, gpt_small on CPU
    python benchmarks/bench_adamw.py --preset gpt2_xl
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def time_steps(opt: torch.optim.Optimizer, steps: int, sync) -> list[float]:
    out = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2" if cuda else "gpt_small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    from lightning_par.models import GPTModule

    device = torch.device("cuda:0" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    with torch.device(device):
        net = GPTModule(preset=a.preset).build_net(device=None)
    params = [p for p in net.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    kinds = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}}
    if cuda:
        kinds["fused"] = {"fused": True}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for rep in range(a.reps):
        for k in (list(kinds) if rep % 2 == 0 else list(kinds)[::-1]):
            opt = torch.optim.AdamW(params, lr=1e-4, **kinds[k])
            time_steps(opt, a.warmup, sync)
            times[k].extend(time_steps(opt, a.steps, sync))
            del opt
    n = sum(p.numel() for p in params)
    name = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"device {name}  torch {torch.__version__}  model {a.preset} ({n / 1e6:.1f}M params, "
          f"{len(params)} tensors, fp32)  {a.reps} reps x {a.steps} steps")
    print(f"{'AdamW':<10}{'step ms':>10}")
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, t in med.items():
        print(f"{k:<10}{1000 * t:>10.3f}")
    if "fused" in med:
        print(f"ratio fused / foreach = {med['fused'] / med['foreach']:.3f}")
    print(f"ratio foreach / for-loop = {med['foreach'] / med['for-loop']:.3f}")


if __name__ == "__main__":
    main()
