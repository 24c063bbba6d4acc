"""Benchmark: the estimator's per-rank peak for tiled runs with bf16 gathers against measured RSS (CPU).

On a CPU every tensor of a run lives in the process's resident memory, so the estimate can be held
against the peak RSS itself. Per case, two runs of the app with the same overrides: ``mode=estimate``
(estimate.json: the configured strategy's row, ``peak``, which on a CPU includes the offload's host
memory: the "device" and the host are the same memory) and a short training run (summary.json:
``memory[]``). What the run added is ``peak_rss - rss_before_setup`` (the resident bytes when the
fit's setup began: the interpreter, torch, Lightning; no part of the model), the largest over the
ranks. The ratio estimate / measured should stay within 0.85-1.15 (issue 22: +-15%).

Each training run goes twice: with glibc's default allocator, and with ``MALLOC_MMAP_THRESHOLD_`` fixed
at 1 MiB. By default glibc raises its mmap threshold after large frees (up to 32 MiB), so tensors up to
that size -- every tile here -- come from heaps whose freed pages it keeps; resident memory then holds
freed tensors too, which no tensor-level model (the estimator's, or torch's MemTracker) sees. With the
threshold fixed every tensor of 1 MiB or more is its own mapping, returned when freed, and RSS follows
the live tensors.

The model is the GPT at a width where the large layers dominate (hidden 1024, vocabulary 50304, 4
layers), fp32 (``32-true``) with FSDP gathering parameters in bf16 and reducing gradients in fp32,
every large layer (attention projections, MLP, head, embedding) in 4 tiles, AdamW.

    python benchmarks/bench_tiled_rss.py                 # fsdp and zero3_offload at 2 ranks
    python benchmarks/bench_tiled_rss.py --hidden 512 --cases fsdp
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiling(layers: int, tiles: int) -> str:
    """Every large layer of the GPT preset in ``tiles`` tiles (the paths ``mode=advise`` tiles)."""
    paths = ["net.embed.tok", "net.head.lm_head"]
    for i in range(layers):
        paths += [f"net.blocks.{i}.attn.{p}" for p in ("wq", "wk", "wv", "wo")]
        paths += [f"net.blocks.{i}.mlp.{p}" for p in ("fc", "proj")]
    return "+strategy.tiling={" + ",".join(f"{p}:{tiles}" for p in paths) + "}"


def run(args: list[str], out: Path, **env_extra: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_extra)
    done = subprocess.run([sys.executable, "run.py", *args, f"paths.output_dir={out}"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(args)} failed:\n{(done.stdout + done.stderr)[-3000:]}")


def overrides(hidden: int, layers: int, tiles: int, devices: int) -> list[str]:
    """The app's overrides of one case (the strategy apart)."""
    return ["model=gpt_small", f"+model.n_embd={hidden}", f"+model.n_layer={layers}",
            f"+model.n_head={max(1, hidden // 64)}", "+model.vocab_size=50304", "model.optimizer=adamw",
            "data=synthetic", "data.vocab_size=50304", "data.seq_len=128", f"data.global_batch_size={2 * devices}",
            f"trainer.devices={devices}", "trainer.precision=32-true", "strategy.param_dtype=bf16",
            "strategy.reduce_dtype=fp32", "strategy.activation_checkpointing=true", tiling(layers, tiles),
            "check_memory=false"]


#: the allocator settings each training run goes under
ALLOCATORS = {"glibc default": {}, "mmap threshold 1 MiB": {"MALLOC_MMAP_THRESHOLD_": "1048576"}}


def predicted_peak(case: str, common: list[str], out: Path) -> int:
    """``mode=estimate``'s peak for the configured strategy on a CPU (there the offloaded states are in it)."""
    run([f"strategy={case}", *common, "mode=estimate", "+estimate.device=cpu"], out)
    rows = json.loads((out / "estimate.json").read_text())["strategies"]
    return next(r for r in rows if r["strategy"] == case)["peak"]


def measured(case: str, common: list[str], steps: int, out: Path, env: dict[str, str]) -> tuple[int, float]:
    """(the largest rank's ``peak_rss - rss_before_setup``, step time) of a short training run."""
    run([f"strategy={case}", *common, f"trainer.max_steps={steps}", "trainer.limit_val_batches=0",
         "callbacks.throughput.warmup_steps=1"], out, **env)
    summary = json.loads((out / "summary.json").read_text())
    return max(m["peak_rss"] - m["rss_before_setup"] for m in summary["memory"]), summary["step_time_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tiles", type=int, default=4)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cases", nargs="+", default=["fsdp", "zero3_offload"])
    a = ap.parse_args()
    common = overrides(a.hidden, a.layers, a.tiles, a.devices)
    print(f"GPT hidden {a.hidden}, {a.layers} layers, vocabulary 50304, every large layer in {a.tiles} tiles; "
          f"32-true, bf16 gathers, fp32 reduce; {a.devices} ranks; CPU")
    print(f"{'strategy':16s} {'allocator':>22s} {'estimate (MiB)':>15s} {'RSS added (MiB)':>16s} {'estimate / RSS':>15s} "
          f"{'step s':>8s}")
    with tempfile.TemporaryDirectory() as tmp:
        for case in a.cases:
            predicted = predicted_peak(case, common, Path(tmp) / f"{case}-est")
            for allocator, env in ALLOCATORS.items():
                added, step_s = measured(case, common, a.steps, Path(tmp) / f"{case}-fit", env)
                print(f"{case:16s} {allocator:>22s} {predicted / 2**20:15.1f} {added / 2**20:16.1f} "
                      f"{predicted / added:15.3f} {step_s:8.2f}")


if __name__ == "__main__":
    main()
