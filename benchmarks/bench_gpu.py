"""The GPU table in one command: a 1B Llama trained by a plain loop, transformers' Trainer and lightning_par
with each speed lever, offload, and the estimator's and the advisor's predictions against what was measured.

    python benchmarks/bench_gpu.py                  # one CUDA GPU: the whole table (about 6 minutes on an H100/H200)
    python benchmarks/bench_gpu.py --dry            # CPU, a tiny Llama, a few steps: the same code, every row
    python benchmarks/bench_gpu.py --rows plain,single,single+compile

One process, one device, rows one after another (the allocator's peak reset between them). Every row
trains the same model on the same synthetic tokens at the same batch and precision (bf16-mixed on a GPU;
fp32 in ``--dry``), AdamW (fused on CUDA):

- ``plain``: a hand-written loop (autocast, SDPA through transformers, fused AdamW, zero_grad after the step);
- ``trainer``: transformers' ``Trainer`` (``bf16``, ``adamw_torch_fused``);
- ``single`` / ``fsdp`` (one GPU): the app (``lightning-par strategy=...``, in this process), alone and with
  each lever: ``compile=model``, ``model.float8=tensorwise`` (with compile, as torchao asks for speed),
  ``model.chunked_loss=true``, ``strategy.activation_checkpointing=selective``, and all of them;
- ``host offload`` / ``disk offload``: ``strategy=zero3_offload`` without and with ``strategy.offload_dir``,
  on a smaller model (gpt2_medium, 8 x 1024 on a GPU), fewer steps.

Step time: the median step after the warm-up (lightning_par's throughput monitor; the plain loop and the
Trainer in windows of ``--window`` steps, one device synchronisation each). MFU: torch's FLOP counter's
model FLOPs over the dense peak of the matmul dtype (``lightning_par/core/devices.py``). Peak: the CUDA
allocator's ``max_memory_allocated`` (none on CPU). Then the estimator's peak for single and fsdp (and with
chunked loss and selective checkpointing) against the measured one, and the advisor's predicted step for
this model and batch on this GPU against the measured ``single`` step.

It writes ``bench_gpu.json`` (every figure) and ``bench_gpu.md`` (the tables) into ``--out``.
``--dry`` is what CI runs (tests/test_bench_gpu.py): its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Setup:
    device: torch.device
    model: str  # a model config of lightning_par/conf/model
    batch: int
    seq_len: int
    precision: str
    steps: int
    warmup: int
    window: int
    offload_model: str
    offload_batch: int
    offload_seq_len: int
    offload_steps: int
    compile_kwargs: dict[str, Any] = field(default_factory=dict)  # --dry: Dynamo without Inductor's codegen
    out: Path = Path(".")


@dataclass
class Row:
    name: str
    step_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_bytes: int | None = None
    final_loss: float | None = None
    error: str | None = None
    overrides: list[str] = field(default_factory=list)


LEVERS = {"compile": ["compile=model"], "float8": ["model.float8=tensorwise", "compile=model"],
          "chunked CE": ["model.chunked_loss=true"], "selective AC": ["strategy.activation_checkpointing=selective"]}
ALL_LEVERS = ["compile=model", "model.float8=tensorwise", "model.chunked_loss=true",
              "strategy.activation_checkpointing=selective"]
APP_ROWS: dict[str, list[str]] = {
    "single": ["strategy=single"],
    **{f"single+{k}": ["strategy=single", *v] for k, v in LEVERS.items()},
    "single+all": ["strategy=single", *ALL_LEVERS],
    "fsdp": ["strategy=fsdp", "trainer.devices=1"],
    "fsdp+all": ["strategy=fsdp", "trainer.devices=1", *ALL_LEVERS],
}
OFFLOAD_ROWS = {"host offload": ["strategy=zero3_offload"], "disk offload": ["strategy=zero3_offload"]}
ROWS = ["plain", "trainer", *APP_ROWS, *OFFLOAD_ROWS]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _data(s: Setup, vocab: int, batch: int, seq_len: int, steps: int) -> Any:
    from lightning_par.data import SyntheticTokens

    dm = SyntheticTokens(n_samples=batch * (steps + 2), seq_len=seq_len, vocab_size=vocab, global_batch_size=batch)
    dm.setup("fit")
    return dm


def _module(name: str, seq_len: int, *overrides: str) -> Any:
    """The LightningModule ``model=name`` builds (its config node, as the app instantiates it)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from lightning_par.models.build import instantiate_model

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_par.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={name}", f"data.seq_len={seq_len}", *overrides])
    return instantiate_model(cfg.model)


def _windowed(device: torch.device, window: int, warmup: int) -> tuple[list[float], Any]:
    """Per-step times measured in windows of ``window`` steps (one synchronisation each); ``tick(step)``."""
    times: list[float] = []
    state = {"start": None, "last": 0}

    def tick(step: int) -> None:
        if state["start"] is None:
            _sync(device)
            state["start"], state["last"] = time.perf_counter(), step
            return
        if step - state["last"] >= (window if device.type == "cuda" else 1):
            _sync(device)
            now = time.perf_counter()
            n = step - state["last"]
            times.extend([(now - state["start"]) / n] * n)
            state["start"], state["last"] = now, step

    return times, tick


def _median_after(times: list[float], warmup: int) -> float | None:
    kept = times[warmup:] or times
    return statistics.median(kept) if kept else None


def plain_loop(s: Setup) -> Row:
    import torch.nn.functional as F

    module = _module(s.model, s.seq_len)
    torch.manual_seed(0)
    net = module.build_hf(s.device)  # the transformers model itself, as the app's run trains it
    fused = {"fused": True} if s.device.type == "cuda" else {"foreach": True}
    # the app's optimizer settings for this model (its lr, betas, weight decay; constant schedule)
    opt = torch.optim.AdamW(net.parameters(), lr=module.lr, betas=tuple(module.betas),
                            weight_decay=module.weight_decay, **fused)
    autocast = (torch.autocast(s.device.type, dtype=torch.bfloat16) if s.precision == "bf16-mixed"
                else contextlib.nullcontext())
    loader = _data(s, module.hf_config.vocab_size, s.batch, s.seq_len, s.steps).train_dataloader()
    times, tick = _windowed(s.device, s.window, s.warmup)
    loss = None
    tick(0)
    for step, (x, y) in enumerate(loader, start=1):
        x, y = x.to(s.device, non_blocking=True), y.to(s.device, non_blocking=True)
        with autocast:
            logits = net(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tick(step)
        if step == s.steps:
            break
    return _row("plain", s, module, _median_after(times, s.warmup), float(loss))


def hf_trainer(s: Setup) -> Row:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    module = _module(s.model, s.seq_len)
    torch.manual_seed(0)
    net = module.build_hf(s.device)
    dm = _data(s, module.hf_config.vocab_size, s.batch, s.seq_len, s.steps)
    # transformers shifts the labels itself: the same tokens as input and label
    windows = dm.train_dataloader().dataset
    rows = [{"input_ids": windows[i][0], "labels": windows[i][0]} for i in range(len(windows))]
    times, tick = _windowed(s.device, s.window, s.warmup)
    losses: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 0:
                tick(0)

        def on_step_end(self, args, state, control, **kw):
            tick(state.global_step)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    cuda = s.device.type == "cuda"
    args = TrainingArguments(output_dir=str(s.out / "trainer"), per_device_train_batch_size=s.batch,
                             max_steps=s.steps, learning_rate=module.lr, adam_beta1=module.betas[0],
                             adam_beta2=module.betas[1], weight_decay=module.weight_decay, max_grad_norm=0.0,
                             bf16=s.precision == "bf16-mixed",
                             optim="adamw_torch_fused" if cuda else "adamw_torch", logging_steps=s.steps,
                             save_strategy="no", report_to=[], dataloader_num_workers=0, use_cpu=not cuda,
                             disable_tqdm=True, lr_scheduler_type="constant", warmup_steps=0)
    if cuda:  # outside a distributed launch transformers spreads the batch over every visible GPU (DataParallel):
        _ = args.device  # one GPU, as every other row (the same override transformers makes for model parallelism)
        args._n_gpu = 1
    Trainer(model=net, args=args, train_dataset=rows, callbacks=[Timer()]).train()
    return _row("trainer", s, module, _median_after(times, s.warmup), losses[-1] if losses else None)


def _row(name: str, s: Setup, module: Any, step_s: float | None, loss: float | None) -> Row:
    from lightning_par.callbacks.throughput import model_flops_per_batch, precision_dtype
    from lightning_par.core.devices import peak_flops_per_device

    peak = peak_flops_per_device(s.device, precision_dtype(s.precision))
    flops = model_flops_per_batch(module, s.batch)
    return Row(name, step_s, s.batch * s.seq_len / step_s if step_s else None,
               flops / step_s / peak if flops and peak and step_s else None, _allocator_peak(s), loss)


def _allocator_peak(s: Setup) -> int | None:
    return int(torch.cuda.max_memory_allocated(s.device)) if s.device.type == "cuda" else None


def app_row(s: Setup, name: str, overrides: list[str]) -> Row:
    """The app in this process (``lightning_par.cli``'s checks and run), its summary's figures."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from lightning_par import cli

    levers = list(overrides)
    offload = name in OFFLOAD_ROWS
    model, batch, seq = ((s.offload_model, s.offload_batch, s.offload_seq_len) if offload
                         else (s.model, s.batch, s.seq_len))
    steps = s.offload_steps if offload else s.steps
    run = Path(tempfile.mkdtemp(prefix="run_", dir=s.out))
    overrides = [f"model={model}", "data=synthetic", f"data.seq_len={seq}", f"data.global_batch_size={batch}",
                 f"data.n_samples={batch * (steps + 2)}", f"trainer.max_steps={steps}",
                 f"trainer.precision={s.precision}", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
                 f"trainer.accelerator={s.device.type}", f"callbacks.throughput.warmup_steps={min(s.warmup, steps - 1)}",
                 f"callbacks.throughput.every_n_steps={s.window}", f"paths.output_dir={run}", *overrides]
    if name == "disk offload":
        overrides.append(f"strategy.offload_dir={run / 'tier'}")
    if s.compile_kwargs and "compile=model" in overrides:  # --dry: the same scope, Dynamo only
        kwargs = ",".join(f"{k}:{v}" for k, v in {**s.compile_kwargs, "scope": "model"}.items())
        overrides = [o if o != "compile=model" else f"compile={{{kwargs}}}" for o in overrides]
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_par.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    cli._run(cfg)
    summary = json.loads((run / "summary.json").read_text())
    return Row(name, summary.get("step_time_s"), summary.get("tokens_per_s"), summary.get("mfu"),
               _allocator_peak(s), summary.get("final_loss"), overrides=levers)


def estimates(s: Setup, measured: dict[str, Row]) -> list[dict[str, Any]]:
    """The estimator's peak (``costs/estimate.estimate``, device cuda, or cpu in --dry) against the measured."""
    from lightning_par.costs.estimate import estimate
    from lightning_par.costs.shape import Shape

    out = []
    for name, strategy, ckpt, chunked in (("single", "single", False, False), ("fsdp", "fsdp", False, False),
                                           ("single+chunked CE", "single", False, True),
                                           ("single+selective AC", "single", "selective", False)):
        module = _module(s.model, s.seq_len, *(["model.chunked_loss=true"] if chunked else []))
        shape = Shape.of_model(module, s.seq_len)
        e = estimate(shape, devices=1, strategy=strategy, precision=s.precision, optimizer="adamw",
                     micro_batch_size=s.batch, checkpointing=ckpt, device=s.device.type)
        got = measured.get(name)
        peak = got.peak_bytes if got is not None else None
        out.append({"row": name, "estimate_bytes": int(e.peak), "measured_bytes": peak,
                    "ratio": e.peak / peak if peak else None})
    return out


def advisor_step(s: Setup, measured: dict[str, Row]) -> dict[str, Any]:
    """The advisor's answer for this model and batch on one device of this GPU's class, against ``single``."""
    from lightning_par.costs.measured import gpu_class
    from lightning_par.modes.advise import main as advise

    gpu = gpu_class(torch.cuda.get_device_name(s.device)) if s.device.type == "cuda" else None
    argv = ["--model", s.model, "--devices-per-node", "1", "--seq-len", str(s.seq_len), "--micro-batch-size",
            str(s.batch), "--global-batch", str(s.batch), "--precision", s.precision, "--no-checkpointing"]
    if gpu:
        argv += ["--gpu", gpu]
    if s.device.type == "cuda":  # this device's own memory and peak (a class's are nominal; an unknown one has none)
        from lightning_par.callbacks.throughput import precision_dtype
        from lightning_par.core.devices import peak_flops_per_device

        argv += ["--device-memory", f"{torch.cuda.get_device_properties(s.device).total_memory / 2**30:.2f}"]
        peak = peak_flops_per_device(s.device, precision_dtype(s.precision))
        if peak:
            argv += ["--peak-tflops", f"{peak / 1e12:g}"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        advice = advise(argv)
    text = printed.getvalue()
    plan = text.splitlines()[0].removeprefix("Recommended: ")
    seconds = advice.chosen.seconds
    efficiency = re.search(r"^Efficiency: .*$", text, re.M)
    single = measured.get("single")
    got = single.step_s if single is not None else None
    return {"argv": argv, "plan": plan, "predicted_s": seconds, "measured_s": got,
            "ratio": seconds / got if got else None, "efficiency": efficiency.group(0) if efficiency else None,
            "gpu_class": gpu}


def markdown(s: Setup, rows: list[Row], est: list[dict], adv: dict | None, env: dict) -> str:
    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    plain = next((r.step_s for r in rows if r.name == "plain" and r.step_s), None)
    lines = [f"{env['device']}, torch {env['torch']}, {s.model} {s.batch} x {s.seq_len} tokens, {s.precision}, "
             f"{s.steps} steps (median after {s.warmup}); offload rows: {s.offload_model} {s.offload_batch} x "
             f"{s.offload_seq_len}, {s.offload_steps} steps", "",
             "| run | step ms | tokens/s | MFU | peak GiB | vs plain | final loss |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.name} | failed: {r.error} | | | | | |")
            continue
        ratio = r.step_s / plain if plain and r.step_s and r.name not in OFFLOAD_ROWS else None
        lines.append(f"| {r.name} | {f(r.step_s and 1000 * r.step_s, '.1f')} | {f(r.tokens_per_s, ',.0f')} | "
                     f"{f(r.mfu and 100 * r.mfu, '.1f')}{'%' if r.mfu else ''} | "
                     f"{f(r.peak_bytes and r.peak_bytes / 2**30, '.2f')} | {f(ratio, '.3f')} | {f(r.final_loss, '.4f')} |")
    lines += ["", "| estimate of | estimated GiB | measured GiB | estimated / measured |", "|---|---|---|---|"]
    for e in est:
        lines.append(f"| {e['row']} | {e['estimate_bytes'] / 2**30:.2f} | "
                     f"{f(e['measured_bytes'] and e['measured_bytes'] / 2**30, '.2f')} | {f(e['ratio'], '.3f')} |")
    if adv:
        lines += ["", f"Advisor (`lightning-par-advise {' '.join(adv['argv'])}`): {adv['plan']}, predicted "
                  f"{adv['predicted_s']:.4g} s a step; measured single {f(adv['measured_s'], '.4g')} s "
                  f"(predicted / measured {f(adv['ratio'], '.3f')}). {adv['efficiency'] or ''}"]
    return "\n".join(lines) + "\n"


def setup(args: argparse.Namespace) -> Setup:
    if args.dry:
        return Setup(torch.device("cpu"), "hf_llama_tiny", 2, 64, "32-true", steps=4, warmup=1, window=1,
                     offload_model="gpt_tiny", offload_batch=2, offload_seq_len=64, offload_steps=3,
                     compile_kwargs={"backend": "eager"}, out=args.out)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py: no CUDA device (use --dry for the CPU check of the code path)")
    # offload rows: two windows after the warm-up, so their step time is a median, not one step
    return Setup(torch.device("cuda:0"), args.model, args.batch, args.seq_len, "bf16-mixed", args.steps,
                 args.warmup, args.window, "gpt2_medium", 8, 1024, offload_steps=args.warmup + 2 * args.window,
                 out=args.out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry", action="store_true", help="CPU, a tiny Llama, a few steps: the code path, no figures")
    p.add_argument("--out", type=Path, default=Path("bench_gpu_out"), help="where the JSON and markdown go")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows (default: all): " + ", ".join(ROWS))
    p.add_argument("--model", default="hf_llama_1b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--window", type=int, default=5, help="steps per device synchronisation (plain loop, Trainer)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no further row after this many seconds (the estimates, advisor and tables still come)")
    args = p.parse_args(argv)
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    s = setup(args)
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    env = {"device": torch.cuda.get_device_name(s.device) if s.device.type == "cuda"
           else f"CPU {platform.machine()} ({torch.get_num_threads()} threads)", "torch": torch.__version__,
           "dry": args.dry}
    rows: list[Row] = []
    started = time.perf_counter()
    for name in args.rows.split(","):
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            rows.append(Row(name, error=f"not run: past --budget-s {args.budget_s:g}"))
            continue
        gc.collect()  # an earlier row's trainer and model (reference cycles) must not count in this row's peak
        if s.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(s.device)
        t0 = time.perf_counter()
        try:
            if name == "plain":
                row = plain_loop(s)
            elif name == "trainer":
                row = hf_trainer(s)
            else:
                row = app_row(s, name, {**APP_ROWS, **OFFLOAD_ROWS}[name])
        except (Exception, SystemExit) as e:  # a failed row is reported in the table; the others still run
            row = Row(name, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        print(f"bench_gpu: {name}: {json.dumps(asdict(row))} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
              flush=True)
        rows.append(row)
        # what was measured so far survives a run stopped from outside (a device lease's time limit)
        (args.out / "bench_gpu_rows.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    by = {r.name: r for r in rows if not r.error}
    failed: dict[str, str] = {}
    est: list[dict[str, Any]] = []
    adv: dict[str, Any] | None = None
    try:
        est = estimates(s, by)
    except (Exception, SystemExit) as e:  # reported, and the tables still written
        failed["estimates"] = f"{type(e).__name__}: {e}"[:300]
    try:
        adv = advisor_step(s, by)
    except (Exception, SystemExit) as e:
        failed["advisor"] = f"{type(e).__name__}: {e}"[:300]
    result = {"env": env, "setup": {k: str(v) for k, v in asdict(s).items()}, "rows": [asdict(r) for r in rows],
              "estimates": est, "advisor": adv, "failed": failed, "seconds": time.perf_counter() - started}
    (args.out / "bench_gpu.json").write_text(json.dumps(result, indent=1))
    table = markdown(s, rows, est, adv, env) + "".join(f"\n{k} failed: {v}\n" for k, v in failed.items())
    (args.out / "bench_gpu.md").write_text(table)
    print(table)
    return result


if __name__ == "__main__":
    result = main()
    failed = [r["name"] for r in result["rows"] if r["error"]] + list(result["failed"])
    if failed:
        sys.exit(f"bench_gpu.py: rows failed: {', '.join(failed)} (see the table)")
