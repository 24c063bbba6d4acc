"""Collectives benchmark in the spirit of nccl-tests: time, algorithm and bus bandwidth per size.

    python -m lightning_par.tools.collectives --ranks 2                            (gloo on CPU, 1K..64M)
    python -m lightning_par.tools.collectives --ranks 8 --max 256M --backend nccl (one GPU per rank)

Spawns ``--ranks`` processes itself (one node), runs all-reduce, all-gather, reduce-scatter,
all-to-all and broadcast on fp32 buffers of each size, and reports for every (op, size) the mean
time of one call (the slowest rank's mean over ``--iters`` calls after ``--warmup``), with
nccl-tests' definitions (``S`` = size in bytes, the full logical buffer as in ``costs/comm.py``:
all-reduce buffer, all-gather output, reduce-scatter input, all-to-all buffer, broadcast buffer):

    algbw = S / t          busbw = algbw * factor,  factor: all-reduce 2(n-1)/n,
                           all-gather and reduce-scatter (n-1)/n, all-to-all (n-1)/n, broadcast 1

busbw is what one rank's link carries per second, comparable with the link's peak. Writes a JSON
(every row) and, with matplotlib (extra ``plots``), a PNG of busbw against size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_par.costs.comm import bus_factor

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
# torch 2.13 renamed the tensor forms of all-gather / reduce-scatter (the old names warn)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def parse_size(text: str) -> int:
    """``"1K"`` -> 1024, ``"256M"`` -> 268435456, ``"4096"`` -> 4096 (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 4096, 1K, 16M, 1G")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]


def fmt_size(n: int) -> str:
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


def sizes_between(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def _buffers(op: str, size: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) fp32 buffers for ``op`` with ``size`` bytes of logical payload; the element
    count is rounded down to a multiple of n so every shard is equal."""
    count = max(n, size // 4 // n * n)
    full = torch.ones(count, dtype=torch.float32, device=device)
    if op == "all_gather":
        return torch.ones(count // n, device=device), full
    if op == "reduce_scatter":
        return full, torch.empty(count // n, device=device)
    return full, torch.empty_like(full)


def _call(op: str, inp: torch.Tensor, out: torch.Tensor) -> None:
    if op == "all_reduce":
        dist.all_reduce(inp)
    elif op == "all_gather":
        _all_gather(out, inp)
    elif op == "reduce_scatter":
        _reduce_scatter(out, inp)
    elif op == "all_to_all":
        dist.all_to_all_single(out, inp)
    else:
        dist.broadcast(inp, src=0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(rank: int, n: int, port: int, backend: str, ops: list[str], sizes: list[int], iters: int,
            warmup: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        if backend == "nccl":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
        dist.init_process_group(backend, rank=rank, world_size=n)
        rows = []
        for op in ops:
            for size in sizes:
                inp, out = _buffers(op, size, n, device)
                for _ in range(warmup):
                    _call(op, inp, out)
                _sync(device)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    _call(op, inp, out)
                _sync(device)
                mean = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
                dist.all_reduce(mean, op=dist.ReduceOp.MAX)  # the slowest rank finishes the collective
                nbytes = (out if op == "all_gather" else inp).numel() * 4
                algbw = nbytes / mean.item() / 1e9
                rows.append({"op": op, "size": nbytes, "time_us": mean.item() * 1e6, "algbw_gbs": algbw,
                             "busbw_gbs": algbw * (bus_factor(op, n) if op != "broadcast" else 1.0)})
        if rank == 0:
            queue.put(("ok", rows))
    except BaseException as exc:  # noqa: BLE001 - one line to the parent, not a traceback per rank
        queue.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(n: int, backend: str, ops: list[str], sizes: list[int], iters: int, warmup: int,
        timeout: float) -> list[dict[str, Any]]:
    """Spawn ``n`` ranks, run the benchmark, return rank 0's rows (raises RuntimeError on failure)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, n, port, backend, ops, sizes, iters, warmup, queue), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    try:
        status, payload = queue.get(timeout=timeout)
    except Exception:  # noqa: BLE001 - queue.Empty: a rank hung or died
        status, payload = "error", f"no result within {timeout:.0f}s (a rank hung or died)"
    finally:
        for p in procs:
            p.join(timeout=10 if status == "ok" else 0.1)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


def format_table(rows: list[dict[str, Any]], n: int, backend: str) -> str:
    lines = [f"# collectives: {n} ranks, {backend}, fp32; algbw = size/time, busbw = algbw x factor (nccl-tests)",
             f"{'op':<15}{'size':>10}{'time (us)':>14}{'algbw GB/s':>13}{'busbw GB/s':>13}"]
    for r in rows:
        lines.append(f"{r['op']:<15}{fmt_size(r['size']):>10}{r['time_us']:>14.1f}{r['algbw_gbs']:>13.3f}"
                     f"{r['busbw_gbs']:>13.3f}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """busbw against size, one line per op; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        xs = [r["size"] for r in mine]
        ax_t.plot(xs, [r["time_us"] for r in mine], marker="o", label=op)
        ax_b.plot(xs, [r["busbw_gbs"] for r in mine], marker="o", label=op)
    for ax, label in ((ax_t, "time per call (us)"), (ax_b, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes, full logical buffer)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_b.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lightning_par.tools.collectives", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2, help="processes to spawn (default 2)")
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                    help="auto: nccl when CUDA is available, else gloo")
    ap.add_argument("--min", dest="lo", type=parse_size, default=parse_size("1K"), help="smallest size (1K)")
    ap.add_argument("--max", dest="hi", type=parse_size, default=parse_size("64M"),
                    help="largest size (64M; --max 256M for the full nccl-tests range)")
    ap.add_argument("--factor", type=int, default=4, help="size multiplier between steps (4)")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    ap.add_argument("--iters", type=int, default=10, help="timed calls per size (10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls first (2)")
    ap.add_argument("--out", type=Path, default=Path("outputs/collectives"), help="directory for JSON and PNG")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before giving up on the ranks")
    args = ap.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    backend = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    problems = [f"unknown op {o!r} (choose from {', '.join(OPS)})" for o in ops if o not in OPS]
    if args.ranks < 2:
        problems.append(f"--ranks must be at least 2, got {args.ranks}")
    if args.lo > args.hi or args.factor < 2 or args.iters < 1 or args.warmup < 0:
        problems.append("need --min <= --max, --factor >= 2, --iters >= 1, --warmup >= 0")
    if backend == "nccl" and not torch.cuda.is_available():
        problems.append("--backend nccl needs CUDA, which is not available here; use gloo")
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    sizes = sizes_between(args.lo, args.hi, args.factor)
    try:
        rows = run(args.ranks, backend, ops, sizes, args.iters, args.warmup, args.timeout)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_table(rows, args.ranks, backend))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"ranks": args.ranks, "backend": backend, "dtype": "float32", "iters": args.iters, "warmup": args.warmup,
            "device": torch.cuda.get_device_name(0) if backend == "nccl" else "cpu", "torch": torch.__version__,
            "busbw_factor": {op: (bus_factor(op, args.ranks) if op != "broadcast" else 1.0) for op in ops}}
    stem = f"collectives_{backend}_{args.ranks}ranks"
    (args.out / f"{stem}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out / f'{stem}.json'}")
    png = args.out / f"{stem}.png"
    if plot(rows, png, f"{backend}, {args.ranks} ranks ({meta['device']}), fp32"):
        print(f"wrote {png}")
    else:
        print("plot skipped: matplotlib is missing (pip install 'lightning_par[plots]')", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
