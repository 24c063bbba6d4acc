"""Benchmark: lightning_par's ``ddp`` against Lightning's built-in ``DDPStrategy``.

Same model (GPT, ``--preset``), same data, same machine, same processes: N ranks are started once
(gloo on CPU, NCCL on GPU) and each rank trains both strategies in turn, interleaved over
``--reps`` repetitions, so drifts of the machine's load hit both equally. The figure is the
median optimizer-step time after warm-up (lightning_par's ThroughputMonitor), and the ratio
ours / Lightning's (below 1: ours is faster).

    python benchmarks/bench_ddp.py --devices 2 --steps 30 --reps 3
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy as LightningDDP

    from lightning_par.callbacks import ThroughputMonitor
    from lightning_par.data import TextDataModule
    from lightning_par.models import GPTModule
    from lightning_par.strategies import DDPStrategy

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    makers = {"lightning_par ddp": DDPStrategy, "lightning DDPStrategy": LightningDDP}
    times: dict[str, list[float]] = {name: [] for name in makers}
    for rep in range(args.reps):
        order = list(makers) if rep % 2 == 0 else list(reversed(makers))
        for name in order:
            L.seed_everything(0, verbose=False)
            model = GPTModule(preset=args.preset, seq_len=args.seq_len)
            data = TextDataModule(seq_len=args.seq_len, global_batch_size=args.global_batch_size, max_bytes=2_000_000)
            meter = ThroughputMonitor(warmup_steps=3)
            trainer = L.Trainer(accelerator=accelerator, devices=args.devices, strategy=makers[name](),
                                max_steps=args.steps, callbacks=[meter], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                                limit_val_batches=0, precision=args.precision)
            trainer.fit(model, datamodule=data)
            times[name].append(meter.summary()["step_time_s"])
    if int(os.environ["RANK"]) == 0:
        ours, theirs = (statistics.median(times[n]) for n in makers)
        print(f"model {args.preset}  ranks {args.devices}  global batch {args.global_batch_size}  "
              f"precision {args.precision}  steps {args.steps} x {args.reps} reps")
        for name in makers:
            print(f"  {name:24s} median step {1000 * statistics.median(times[name]):8.2f} ms   "
                  f"per rep: {', '.join(f'{1000 * t:.2f}' for t in times[name])}")
        print(f"step-time ratio ours/Lightning = {ours / theirs:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--preset", default="gpt_small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    port = str(free_port())
    procs = []
    for rank in range(args.devices):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank),
                   NODE_RANK="0", WORLD_SIZE=str(args.devices), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
