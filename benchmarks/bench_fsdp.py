"""Step time of lightning_par's ``zero3`` / ``fsdp`` against Lightning's own ``ModelParallelStrategy``
with the same ``fully_shard`` applied by hand in ``LightningModule.configure_model``.

Everything else is equal: same model (a GPT preset, same seed), same data (synthetic tokens, same
order), same machine, same N processes. One command starts the N ranks once; each rank then runs
``reps`` rounds, and every round fits each contender for ``steps`` optimizer steps in a rotating
order (interleaved, so drifts in machine load hit all contenders alike). Step time = wall time
between consecutive optimizer-step ends, after ``warmup`` steps, median over all rounds.

    python benchmarks/bench_fsdp.py                      # 2 CPU ranks (gloo), gpt_small
    python benchmarks/bench_fsdp.py --devices 4 --preset gpt2 --steps 10

The hand-written sharding mirrors ``lightning_par.parallel.sharding.fsdp.apply_fsdp`` for the defaults of
``zero3``: each block a unit, then the root; forward/backward prefetch of one block; FSDP hooks on
``training_step``. So the ratio measures the strategies' plumbing, not different sharding.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.multiprocessing as mp

from lightning_par.data import SyntheticTokens
from lightning_par.models import GPTModule


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter())


class HandShardedGPT(GPTModule):
    """GPTModule whose configure_model applies FSDP2 by hand (what Lightning's docs ask for)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        super().configure_model()  # builds the architecture (real tensors under Lightning's strategy)
        mesh = self.device_mesh["data_parallel"]
        blocks = list(self.net.blocks)
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(self, mesh=mesh, reshard_after_forward=True)
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])
        register_fsdp_forward_method(self, "training_step")


def make_strategy(name: str, devices: int):
    if name == "lightning":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    from lightning_par.strategies import FSDPStrategy, Zero3Strategy

    return Zero3Strategy() if name == "zero3" else FSDPStrategy()


def fit_once(name: str, args: argparse.Namespace) -> list[float]:
    L.seed_everything(0, verbose=False)
    cls = HandShardedGPT if name == "lightning" else GPTModule
    model = cls(preset=args.preset, seq_len=args.seq_len, optimizer="adamw", lr=1e-3)
    data = SyntheticTokens(n_samples=args.batch * (args.steps + 1), seq_len=args.seq_len,
                           vocab_size=model.config.vocab_size, global_batch_size=args.batch)
    timer = StepTimer()
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=make_strategy(name, args.devices),
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, limit_val_batches=0,
                        callbacks=[timer])
    trainer.fit(model, datamodule=data)
    return [b - a for a, b in zip(timer.ends[args.warmup:], timer.ends[args.warmup + 1:])]


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(args.devices))  # LOCAL_RANK set: Lightning does not start processes itself
    torch.set_num_threads(args.threads)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    contenders = ["zero3", "fsdp", "lightning"]
    times: dict[str, list[float]] = {c: [] for c in contenders}
    for rep in range(args.reps):
        order = contenders[rep % 3:] + contenders[:rep % 3]  # rotate who goes first
        for name in order:
            os.environ["WORLD_SIZE"] = str(args.devices)  # Lightning's teardown removes it
            times[name].extend(fit_once(name, args))
            if rank == 0:
                print(f"round {rep + 1}/{args.reps} {name:>9}: median step "
                      f"{1000 * statistics.median(times[name][-(args.steps - args.warmup - 1):]):.1f} ms", flush=True)
    if rank == 0:
        med = {c: statistics.median(t) for c, t in times.items()}
        print(f"\n{args.devices} CPU ranks (gloo), {args.preset}, global batch {args.batch} x {args.seq_len} tokens, "
              f"{args.reps} rounds x {args.steps - args.warmup - 1} timed steps per contender")
        print(f"{'strategy':<44} {'median step':>12} {'ratio':>7}")
        names = {"zero3": "lightning_par zero3", "fsdp": "lightning_par fsdp",
                 "lightning": "Lightning ModelParallelStrategy + fully_shard"}
        for c in contenders:
            print(f"{names[c]:<44} {1000 * med[c]:>9.1f} ms {med[c] / med['lightning']:>7.3f}")
        print(f"step-time ratio ours / Lightning's: zero3 {med['zero3'] / med['lightning']:.3f}, "
              f"fsdp {med['fsdp'] / med['lightning']:.3f}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--preset", default="gpt_small")
    ap.add_argument("--batch", type=int, default=16, help="global batch size")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args(argv)
    mp.start_processes(worker, args=(args, free_port()), nprocs=args.devices, start_method="spawn")


if __name__ == "__main__":
    main()
