"""``mode=find_batch_size``: the largest micro-batch per rank that runs, under any strategy and world size.

Lightning's ``BatchSizeFinder`` refuses distributed strategies. Here each *try* is a short real
training job of this run's config (``find_batch_size.steps`` optimizer steps: forward, backward,
optimizer step and the strategy's communication, on every rank at once) with the micro-batch under
test, started as a fresh ``python -m lightning_par`` process group. Fresh processes are the point:

- on CPU nothing runs out of memory, so a try fits when every rank's *peak resident set size* stays
  within ``find_batch_size.max_memory_gb``. A process's RSS high-water mark never goes down, so in
  one long-lived process the second try would report the first try's peak; a new process per try
  measures each size on its own;
- on CUDA a try fails when any rank runs out of memory: that rank dies, the launcher stops the
  others (``strategies/launcher.py``) and the job's error.json names the ``OutOfMemoryError``, so
  all ranks agree on the outcome without a collective that an out-of-memory rank could never join;
  process exit frees every byte before the next try. ``max_memory_gb`` optionally caps the peak
  allocated memory too (headroom).

Search: seeded by the estimator (``estimate.estimate``: the largest power of two whose estimated
memory fits the cap), doubling while tries fit, halving while they do not, then binary search between
the largest size that fit and the smallest that did not. Any other failure ends the search with that
try's error. The result keeps the user's ``data.global_batch_size``: the smallest
``trainer.accumulate_grad_batches`` whose micro-batch fits. It is printed as a command and written to
the run directory's summary.json (``find_batch_size`` key).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import DictConfig

from lightning_par import ConfigError
from lightning_par.callbacks.memory import peak_rss_bytes

GiB = 1024**3
_DROP = ("mode=", "hydra.run.dir=", "trainer.accumulate_grad_batches=", "data.global_batch_size=",
         "trainer.max_steps=", "trainer.limit_val_batches=", "find_batch_size.", "+find_batch_size.")


@dataclass
class Try:
    micro_batch_size: int
    fits: bool
    peak_bytes: int | None  # max over ranks: peak RSS on CPU, peak allocated on CUDA
    error: str | None = None


def accumulation_for(global_batch: int, dp: int, max_micro: int) -> tuple[int, int]:
    """(accumulate_grad_batches, micro-batch): the fewest accumulation steps whose micro-batch divides
    the global batch exactly and is at most ``max_micro``."""
    if global_batch % dp:
        raise ConfigError(f"data.global_batch_size={global_batch} is not divisible by the data-parallel size {dp}")
    per_rank = global_batch // dp
    for k in range(1, per_rank + 1):
        if per_rank % k == 0 and per_rank // k <= max_micro:
            return k, per_rank // k
    raise ConfigError(f"no micro-batch of at most {max_micro} divides {per_rank} samples per rank")


def search(fits: Any, seed: int, limit: int) -> int:
    """The largest ``m`` in [1, limit] with ``fits(m)``, assuming fitting is monotone; 0 if none.
    Starts at ``seed``: doubles while it fits, halves while it does not, then bisects."""
    m = max(1, min(seed, limit))
    if fits(m):
        lo, hi = m, None
        while hi is None and lo < limit:
            m = min(2 * lo, limit)
            lo, hi = (m, None) if fits(m) else (lo, m)
        if hi is None:
            return lo
    else:
        lo, hi = 0, m
        while lo == 0 and hi > 1:
            m = hi // 2
            lo, hi = (m, hi) if fits(m) else (0, m)
        if lo == 0:
            return 0
    while hi - lo > 1:
        m = (lo + hi) // 2
        lo, hi = (m, hi) if fits(m) else (lo, m)
    return lo


def estimator_seed(cfg: DictConfig, model: Any, strategy: str, world: int, cap: int | None, limit: int) -> int:
    """The largest power of two whose estimated per-rank memory fits ``cap`` (1 without a cap, or for
    a strategy or model the estimator cannot price). A model without a GPT shape (Hugging Face, a
    user's module) is traced on fake tensors at each size (``costs/traced.py``)."""
    from lightning_par.core.dtypes import canonical_precision
    from lightning_par.costs.estimate import Shape, estimate, estimate_traced

    if cap is None or cap <= 0:
        return 1
    config = getattr(model, "config", None)
    precision = canonical_precision(cfg.trainer.get("precision", "32-true"))  # Lightning's short forms too
    optimizer = str(cfg.model.get("optimizer", "adamw"))
    # the model's own cost shape (its attention backend, dropout, chunked loss, experts): what mode=estimate prices
    shape = Shape.of_model(model, int(model.seq_len)) if config is not None and hasattr(config, "n_params") else None
    if shape is not None:

        def peak(micro: int) -> int:
            return estimate(config.n_params, devices=world, strategy=strategy, precision=precision,
                            optimizer=optimizer, shape=shape, micro_batch_size=micro).total
    else:
        from lightning_par.models.build import instantiate_model

        from lightning_par.costs.traced import trace_model

        def peak(micro: int) -> int:
            traced = trace_model(lambda: instantiate_model(cfg.model), micro, precision=precision)
            return estimate_traced(traced, devices=world, strategy=strategy).peak
    m = 1
    try:
        while 2 * m <= limit and peak(2 * m) <= cap:
            m *= 2
    except Exception:  # noqa: BLE001 - a strategy, precision or model the estimator cannot price: start at 1
        return 1
    return m


def run_try(overrides: list[str], micro: int, dp: int, steps: int, out_dir: str, timeout: float,
            cap: int | None, on_cuda: bool) -> Try:
    run_dir = os.path.join(out_dir, "tries", f"micro_{micro}")
    cmd = [sys.executable, "-m", "lightning_par", *overrides, "mode=train", f"hydra.run.dir={run_dir}",
           f"data.global_batch_size={micro * dp}", "trainer.accumulate_grad_batches=1",
           f"trainer.max_steps={steps}", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
           "trainer.enable_checkpointing=false"]  # a try's weights are not worth a checkpoint (a fine-tune's default)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"find_batch_size: the try at micro-batch {micro} ran past {timeout:.0f} s "
                           f"(find_batch_size.timeout_s); its output is in {run_dir}") from None
    if proc.returncode != 0:
        error = _error_line(run_dir, proc.stderr)
        if "OutOfMemoryError" in error or "out of memory" in error.lower():
            return Try(micro, False, None, error)
        raise RuntimeError(f"find_batch_size: the try at micro-batch {micro} failed: {error} (see {run_dir})")
    with open(os.path.join(run_dir, "summary.json")) as f:
        ranks = json.load(f)["memory"]
    key = "peak_allocated" if on_cuda else "peak_rss"
    peak = max(int(r[key]) for r in ranks)
    return Try(micro, cap is None or peak <= cap, peak)


def _error_line(run_dir: str, stderr: str) -> str:
    try:
        with open(os.path.join(run_dir, "error.json")) as f:
            err = json.load(f)
        return f"{err.get('type', '')}: {err.get('message', '')}".strip(": ")
    except (OSError, ValueError):
        lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
        return lines[-1] if lines else (stderr.strip().splitlines() or ["no output"])[-1]


def find_batch_size(cfg: DictConfig) -> dict[str, Any]:
    """``lightning-par mode=find_batch_size ...``: search, print the command, write summary.json."""
    import torch
    from hydra.core.hydra_config import HydraConfig

    from lightning_par.run.train import build, validate

    opts = cfg.get("find_batch_size") or {}
    cap_gb = opts.get("max_memory_gb")
    steps, limit = int(opts.get("steps", 2)), int(opts.get("max_micro_batch", 1024))
    timeout = float(opts.get("timeout_s", 600))
    parts = build(cfg)
    strategy, model = parts["strategy"], parts["model"]
    world = validate(cfg, strategy, model, parts["datamodule"])
    on_cuda = bool(torch.cuda.is_available()) and str(cfg.trainer.get("accelerator", "auto")) in ("auto", "gpu", "cuda")
    if cap_gb is None and not on_cuda:
        raise ConfigError("mode=find_batch_size on CPU needs find_batch_size.max_memory_gb (nothing runs out of "
                          "memory on CPU: the cap is the per-rank memory to stay within)")
    cap = int(float(cap_gb) * GiB) if cap_gb is not None else None
    dp = strategy.dims_for(world).dp if hasattr(strategy, "dims_for") else world
    strategy_name = HydraConfig.get().runtime.choices.get("strategy", "single")
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(_DROP)]
    out_dir = str(cfg.paths.output_dir)
    # the estimator models device memory; on CPU the cap also covers the runtime itself (Python, torch,
    # Lightning), which this process has already loaded: its resident size is the seed's baseline
    baseline = 0 if on_cuda else peak_rss_bytes()
    seed = estimator_seed(cfg, model, strategy_name, world, None if cap is None else cap - baseline, limit)
    tries: dict[int, Try] = {}

    def fits(micro: int) -> bool:
        tries[micro] = run_try(overrides, micro, dp, steps, out_dir, timeout, cap, on_cuda)
        t = tries[micro]
        peak = f"{t.peak_bytes / GiB:.3f} GiB" if t.peak_bytes is not None else t.error
        print(f"find_batch_size: micro-batch {micro:>5}: {'fits' if t.fits else 'too big'} ({peak})", flush=True)
        return t.fits

    best = search(fits, seed, limit)
    if best == 0:
        raise ConfigError(f"even a micro-batch of 1 does not fit under {strategy_name} on {world} rank(s)"
                          + (f" within {cap_gb} GB" if cap else "") + "; shard more (zero3, fsdp) or offload")
    global_batch = int(cfg.data.global_batch_size)
    accumulate, micro = accumulation_for(global_batch, dp, best)
    # the global batch is the run's own (dropped from the tries' overrides, which set their own): said
    # explicitly, so the command trains at dp x micro x accumulate sequences per step
    command = " ".join(["lightning-par", *overrides, f"data.global_batch_size={global_batch}",
                        f"trainer.accumulate_grad_batches={accumulate}"])
    result = {"strategy": strategy_name, "world_size": world, "dp": dp, "max_memory_bytes": cap,
              "measure": "peak_allocated" if on_cuda else "peak_rss", "seed": seed,
              "max_micro_batch_size": best, "global_batch_size": global_batch, "micro_batch_size": micro,
              "accumulate_grad_batches": accumulate, "command": command,
              "tries": [asdict(t) for _, t in sorted(tries.items())]}
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({"mode": "find_batch_size", "find_batch_size": result}, f, indent=2)
    print(f"find_batch_size: largest micro-batch per rank {best} (seed {seed}, {len(tries)} tries); "
          f"global batch {global_batch} = {dp} ranks x {micro} x {accumulate} accumulation steps\n{command}")
    return result
