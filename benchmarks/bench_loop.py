"""Benchmark: lightning_par's ``single`` against a hand-written PyTorch training loop.

One process, one device, one run. The same model (the GPT preset's architecture), global batch,
precision and data (lightning_par's synthetic-token data module, whose batches both loops read
through the same DataLoader) are trained by:

- ``plain eager``     a plain loop: forward, cross-entropy, backward, AdamW (fused on CUDA, foreach
                      elsewhere), ``zero_grad(set_to_none=True)``;
- ``plain compiled``  the same loop with every transformer block compiled in place
                      (``block.compile()``, the granularity lightning_par uses);
- ``lightning``       Lightning's own ``Trainer`` (its default single-device strategy) fitting the
                      same LightningModule and data with the app's trainer settings (CSV logger
                      written every 10 steps, no checkpointing, no progress bar), timed by
                      lightning_par's throughput callback alone: the share of the overhead that is
                      Lightning's loop, not lightning_par's;
- ``lp single``       ``lightning-par strategy=single`` (the app, in this process: its default
                      callbacks -- memory, throughput, summary, guard -- included);
- ``lp compiled``     the same with ``compile=true``.

Contestants take turns over ``--reps`` repetitions (the order alternates), so drifts of the
machine's load hit all of them. Step time: the plain loops are timed in windows of
``--window`` steps with one device synchronisation per window, as lightning_par's throughput
monitor does on CUDA (on CPU it times every step: there is nothing to synchronise); the median of
the steps after ``--warmup`` is each repetition's figure, the median over repetitions is
printed, with the ratios ours / plain for eager and for compiled, and lightning / plain and
ours / lightning for eager. MFU counts the model FLOPs of
torch's FLOP counter against the dense peak of the matmul dtype (lightning_par/core/devices.py); peak
memory is the CUDA allocator's peak (not available on CPU).

    python benchmarks/bench_loop.py                       # CPU: gpt_small, batch 8 x 128
    python benchmarks/bench_loop.py --preset gpt2 --batch 16 --seq-len 1024 --precision bf16-mixed
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def make_data(args: argparse.Namespace, vocab_size: int) -> Any:
    from lightning_par.data import SyntheticTokens

    dm = SyntheticTokens(n_samples=max(512, args.batch * (args.steps + 4)), seq_len=args.seq_len,
                         vocab_size=vocab_size, global_batch_size=args.batch)
    dm.setup("fit")
    return dm


def plain_loop(args: argparse.Namespace, device: torch.device, compiled: bool) -> float:
    """Median seconds per step of a hand-written loop."""
    from lightning_par.models import GPTModule

    torch.manual_seed(0)
    module = GPTModule(preset=args.preset, seq_len=args.seq_len)
    with torch.device(device):
        net = module.build_net(device=None)
    if args.precision == "bf16-true":
        net = net.to(torch.bfloat16)
    if compiled:
        for block in net.parallel_plan().blocks:
            net.get_submodule(block).compile()
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0, **fused)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16-mixed"
                else contextlib.nullcontext())
    loader = make_data(args, module.config.vocab_size).train_dataloader()
    times: list[float] = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    window = args.window if device.type == "cuda" else 1
    step, start = 0, None
    while step < args.steps:
        for x, y in loader:
            if start is None:
                sync()
                start = time.perf_counter()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast:
                logits = net(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % window == 0 or step == args.steps:
                sync()
                now = time.perf_counter()
                n = window if step % window == 0 else step % window
                times.extend([(now - start) / n] * n)
                start = now
            if step == args.steps:
                break
    return statistics.median(times[args.warmup:] or times)


def lightning_own(args: argparse.Namespace, device: torch.device) -> float:
    """Median seconds per step of Lightning's own Trainer and single-device strategy."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_par.callbacks.throughput import ThroughputMonitor
    from lightning_par.models import GPTModule

    torch.manual_seed(0)
    module = GPTModule(preset=args.preset, seq_len=args.seq_len)  # AdamW from the optimizer factory
    monitor = ThroughputMonitor(warmup_steps=args.warmup, every_n_steps=args.window)
    out = tempfile.mkdtemp(prefix="bench_loop_")
    trainer = L.Trainer(accelerator=device.type, devices=1, precision=args.precision, max_steps=args.steps,
                        limit_val_batches=0, logger=CSVLogger(out), log_every_n_steps=10, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor], default_root_dir=out)
    trainer.fit(module, datamodule=make_data(args, module.config.vocab_size))
    return monitor.summary()["step_time_s"]


def lightning_par_single(args: argparse.Namespace, compiled: bool) -> dict[str, Any]:
    """The app (``lightning-par strategy=single ...``) in this process; its run summary."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from lightning_par.run.train import train

    out = tempfile.mkdtemp(prefix="bench_loop_")
    overrides = ["strategy=single", f"model={args.preset}", "data=synthetic", f"data.seq_len={args.seq_len}",
                 f"data.global_batch_size={args.batch}", f"data.n_samples={max(512, args.batch * (args.steps + 4))}",
                 f"trainer.max_steps={args.steps}", f"trainer.precision={args.precision}", "trainer.limit_val_batches=0",
                 "trainer.enable_progress_bar=false", "logger=csv", f"compile={str(compiled).lower()}",
                 f"paths.output_dir={out}", f"callbacks.throughput.warmup_steps={args.warmup}",
                 f"callbacks.throughput.every_n_steps={args.window}"]
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_par.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        summary = train(cfg)
    assert summary is not None
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=None, help="GPT preset (default: gpt_small on CPU, gpt2 on CUDA)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: 8 on CPU, 16 on CUDA)")
    p.add_argument("--seq-len", type=int, default=None, help="default: 128 on CPU, 1024 on CUDA")
    p.add_argument("--precision", default=None, help="32-true | bf16-mixed | bf16-true (default: 32-true on "
                                                     "CPU, bf16-mixed on CUDA)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--window", type=int, default=10, help="steps per device synchronisation on CUDA")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--no-compile", action="store_true", help="skip the compiled contestants")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    args.preset = args.preset or ("gpt2" if cuda else "gpt_small")
    args.batch = args.batch or (16 if cuda else 8)
    args.seq_len = args.seq_len or (1024 if cuda else 128)
    args.precision = args.precision or ("bf16-mixed" if cuda else "32-true")
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

    from lightning_par.callbacks.throughput import model_flops_per_batch, precision_dtype
    from lightning_par.core.devices import peak_flops_per_device
    from lightning_par.models import GPTModule

    module = GPTModule(preset=args.preset, seq_len=args.seq_len)
    flops = model_flops_per_batch(module, args.batch)
    peak = peak_flops_per_device(device, precision_dtype(args.precision))
    names = ["plain eager", "lightning", "lp single"] + ([] if args.no_compile else ["plain compiled", "lp compiled"])
    times: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, int | None] = {n: None for n in names}
    for rep in range(args.reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            if name.startswith("plain"):
                times[name].append(plain_loop(args, device, compiled=name.endswith("compiled")))
            elif name == "lightning":
                times[name].append(lightning_own(args, device))
            else:
                times[name].append(lightning_par_single(args, compiled=name.endswith("compiled"))["step_time_s"])
            if cuda:
                peaks[name] = max(peaks[name] or 0, torch.cuda.max_memory_allocated(device))
    tokens = args.batch * args.seq_len
    print(f"\ndevice {device_name(device)}  torch {torch.__version__}")
    print(f"model {args.preset} ({sum(p.numel() for p in module.build_net('meta').parameters()) / 1e6:.1f}M params)  "
          f"batch {args.batch} x {args.seq_len}  precision {args.precision}  steps {args.steps} "
          f"(warm-up {args.warmup}) x {args.reps} reps")
    print(f"{'contestant':16s} {'step ms':>9s} {'tokens/s':>10s} {'MFU':>7s} {'peak mem':>10s}   per rep (ms)")
    for name in names:
        t = statistics.median(times[name])
        mfu = f"{100 * flops / t / peak:6.1f}%" if flops and peak else "     -"
        mem = f"{peaks[name] / 2**30:7.2f} GiB" if peaks[name] else "         -"
        print(f"{name:16s} {1000 * t:9.2f} {tokens / t:10.0f} {mfu:>7s} {mem:>10s}   "
              + ", ".join(f"{1000 * x:.2f}" for x in times[name]))
    for ours, plain in (("lp single", "plain eager"), ("lp compiled", "plain compiled"),
                        ("lightning", "plain eager"), ("lp single", "lightning")):
        if ours in times:
            print(f"ratio {ours} / {plain} = {statistics.median(times[ours]) / statistics.median(times[plain]):.3f}")


if __name__ == "__main__":
    main()
