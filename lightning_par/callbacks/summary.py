"""The run summary: ``summary.json`` (the public contract of docs/architecture.md) and a short printed table.

Losses: the training loss of every optimizer step, as the mean over the global batch. Each rank
records its local loss per optimizer step (summing the accumulation-normalized micro-batch losses
Lightning hands to ``on_train_batch_end``); at the end one all-reduce averages them over ranks
(data-parallel ranks hold equal-size slices, so the mean of means is the global-batch mean; tensor-
and pipeline-parallel ranks of one replica report the same loss). One collective per run, none per
step, and no host synchronisation per step either: the losses stay on the device (``StepLosses``)
until the end. The other measurement callbacks (memory, throughput, pipeline bubble) contribute through
their ``summary()`` methods.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import lightning as L
import torch

from lightning_par.callbacks.throughput import class_name, global_batch_of


CONTRACT_KEYS = ("strategy", "world_size", "mesh", "model", "n_params", "precision", "global_batch_size", "steps",
                 "losses", "final_loss", "step_time_s", "samples_per_s", "tokens_per_s", "mfu", "memory", "bubble")


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, inf) replaced by None: summary.json stays valid JSON
    (``json.dump`` would write bare ``NaN``, which strict JSON parsers reject)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def compile_facts(modules: int | None, scope: str | None = None) -> dict[str, Any] | None:
    """What torch.compile did in this process: its scope, the compiled modules, Dynamo graphs, graph breaks."""
    if not modules:
        return None
    from torch._dynamo.utils import counters

    return {"scope": scope, "modules": int(modules), "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


class StepLosses:
    """Per-step losses kept on the device: a buffer that grows by doubling, written with an indexed
    copy (a kernel launch, no host synchronisation); read once at the end."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self.n = 0

    def append(self, value: torch.Tensor) -> None:
        if self._buf is None:
            self._buf = torch.zeros(256, dtype=torch.float64, device=value.device)
        elif self.n == self._buf.numel():
            self._buf = torch.cat([self._buf, torch.zeros_like(self._buf)])
        self._buf[self.n] = value
        self.n += 1

    def values(self, device: torch.device) -> torch.Tensor:
        if self._buf is None:
            return torch.zeros(0, dtype=torch.float64, device=device)
        return self._buf[: self.n]


class RunSummary(L.Callback):
    """Writes ``summary.json`` from global rank 0 and prints a table.

    Args:
        output_dir: where summary.json goes (Hydra's run directory); None: the trainer's root dir.
        strategy_name / model_name: the config names recorded in the summary.
        extra: further keys to record verbatim (e.g. the data config name).
    """

    def __init__(self, output_dir: str | None = None, strategy_name: str | None = None,
                 model_name: str | None = None, extra: dict[str, Any] | None = None) -> None:
        self.output_dir = output_dir
        self.strategy_name = strategy_name
        self.model_name = model_name
        self.extra = dict(extra or {})
        self._local = StepLosses()
        self._restored: list[float] = []  # global losses of the steps before a resume (from the checkpoint)
        self._current: torch.Tensor | None = None  # this step's loss so far (sum over accumulated micro-batches)
        self._step_seen = 0
        self.n_params = 0
        self.summary: dict[str, Any] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # before the strategy shards or cuts the model: the full parameter count
        self.n_params = sum(p.numel() for p in pl_module.parameters())

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._local, self._current, self._step_seen = StepLosses(), None, trainer.global_step
        self._restored = self._restored[: trainer.global_step]

    def _global_losses(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[float]:
        """Losses of every step so far, averaged over ranks (a collective: every rank must call it)."""
        local = self._local.values(pl_module.device).clone()
        if trainer.world_size > 1:
            local = trainer.strategy.reduce(local, reduce_op="mean")
        return self._restored + [float(x) for x in local.cpu()]

    # The losses travel with checkpoints, so a resumed run (e.g. after torchrun restarts a failed
    # rank) still reports the loss of every step. Lightning dumps checkpoints on every rank.
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["lightning_par_losses"] = self._global_losses(trainer, pl_module)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._restored = list(checkpoint.get("lightning_par_losses", []))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            loss = loss.detach().to(torch.float64) if isinstance(loss, torch.Tensor) else \
                torch.tensor(float(loss), dtype=torch.float64, device=pl_module.device)
            self._current = loss if self._current is None else self._current + loss
        if trainer.global_step != self._step_seen:  # an optimizer step just ended
            self._step_seen = trainer.global_step
            current = self._current if self._current is not None else \
                torch.zeros((), dtype=torch.float64, device=pl_module.device)
            self._local.append(current)
            self._current = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        losses = self._global_losses(trainer, pl_module)
        parts: dict[str, Any] = {}
        for cb in trainer.callbacks:
            if cb is not self and callable(getattr(cb, "finalize", None)):  # whatever the callbacks' order
                cb.finalize(trainer, pl_module)
            if cb is not self and hasattr(cb, "summary") and callable(cb.summary):
                parts.update(cb.summary())
        strategy = trainer.strategy
        mesh = getattr(strategy, "mesh_sizes", None) or {"dp_replicate": trainer.world_size}
        # what the strategy learnt about the model before sharding it (full parameter count, which
        # rule chose the FSDP / checkpointing units); absent under Lightning's own strategies
        facts = dict(getattr(strategy, "model_facts", None) or {})
        self.summary = {
            "strategy": self.strategy_name or type(strategy).__name__,
            "world_size": trainer.world_size,
            "mesh": dict(mesh),
            "model": self.model_name or class_name(pl_module),
            "n_params": int(facts.get("n_params", self.n_params)),
            "units_rule": facts.get("units_rule"),
            "compile": compile_facts(facts.get("compiled_modules"), facts.get("compile_scope")),
            "activation_checkpointing": facts.get("checkpointed_blocks") or None,
            "float8": facts.get("float8"),
            "precision": str(trainer.precision),
            "global_batch_size": global_batch_of(trainer),
            "steps": len(losses),
            "losses": losses,
            "final_loss": losses[-1] if losses else None,
            "step_time_s": None, "samples_per_s": None, "tokens_per_s": None, "mfu": None,
            "memory": [],
            "bubble": None,
            **parts,
            **self.extra,
        }
        pretrained = getattr(pl_module, "pretrained", None)
        if isinstance(pretrained, (str, os.PathLike)) and pretrained:  # a fine-tune: the checkpoint it started from
            self.summary["pretrained"] = os.path.abspath(pretrained)
        if trainer.is_global_zero:
            out = self.output_dir or trainer.default_root_dir
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "summary.json"), "w") as f:
                f.write(json.dumps(json_safe(self.summary), indent=2, allow_nan=False) + "\n")
            print(format_summary(self.summary), flush=True)


def format_summary(s: dict[str, Any]) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in (s.get("mesh") or {}).items())
    fl = s.get("final_loss")
    first = s["losses"][0] if s.get("losses") else None
    lines = [
        f"strategy {s['strategy']}  world {s['world_size']} ({mesh})  model {s['model']} "
        f"({s['n_params'] / 1e6:.2f}M params)  precision {s['precision']}",
        f"steps {s['steps']}  global batch {s['global_batch_size']}  loss {first:.4f} -> {fl:.4f}"
        if fl is not None and first is not None else f"steps {s['steps']}",
    ]
    st = s.get("step_time_s")
    if st:
        extra = f"  {s['tokens_per_s']:.0f} tokens/s" if s.get("tokens_per_s") else ""
        mfu = f"  MFU {100 * s['mfu']:.1f}%" if s.get("mfu") else ""
        samples = f"  {s['samples_per_s']:.1f} samples/s" if s.get("samples_per_s") else ""
        lines.append(f"step {1000 * st:.1f} ms{samples}{extra}{mfu}")
    if s.get("mfu_note"):  # MFU is null because the model's FLOPs could not be counted: say why
        lines.append(f"MFU n/a: {s['mfu_note']}")
    if s.get("bubble"):
        b = s["bubble"]
        # None where nothing was measured (a run too short for a step past the first)
        fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"pipeline bubble measured {fmt(b.get('measured'))}  theory {fmt(b.get('theory'))}")
    mem = s.get("memory") or []
    if mem:
        lines.append(f"{'rank':>4} {'params':>11} {'grads':>11} {'optim':>11} {'offloaded':>11} {'peak alloc':>11}"
                     f" {'peak rss':>11}")
        for m in mem:
            lines.append(f"{m['rank']:>4} {_fmt_bytes(m['params']):>11} {_fmt_bytes(m['grads']):>11} "
                         f"{_fmt_bytes(m['optimizer_state']):>11} {_fmt_bytes(m['offloaded']):>11} "
                         f"{_fmt_bytes(m['peak_allocated']):>11} {_fmt_bytes(m['peak_rss']):>11}")
    return "\n".join(lines)
