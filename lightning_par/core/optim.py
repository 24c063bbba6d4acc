"""Optimizers and learning-rate schedules from plain configuration.

``build_optimizer(params, OptimizerConfig)`` makes ``adamw`` / ``adam`` / ``sgd`` (torch) or
``adamw8bit`` (torchao's ``AdamW8bit``: m and v stored as 8-bit codes with one fp32 scale per block
of 256 elements). torch's Adam-family and SGD get their fastest multi-tensor path for the device the
parameters live on: ``fused=True`` on CUDA (one kernel for all tensors), ``foreach=True`` elsewhere.
Sharded strategies rebuild the inner optimizer from ``optimizer.defaults`` (zero1, zero2), so the
choice carries over to their shards; FSDP's DTensor parameters take the same flags.

``build_scheduler(optimizer, ScheduleConfig, total_steps)`` makes a per-step ``LambdaLR``:

- ``constant``: the base LR (what the default ``scheduler=auto`` picks from scratch: runs without a
  scheduler group choice are unchanged; for a fine-tune, ``model.pretrained`` set, it picks
  ``warmup_linear`` over 10% of the steps, ``conf/scheduler/auto.yaml``);
- ``warmup_cosine``: linear warm-up from 0 over ``warmup_steps``, then cosine decay to
  ``min_lr_ratio`` x base LR at ``total_steps``;
- ``warmup_linear``: linear warm-up, then linear decay to ``min_lr_ratio`` x base LR.

The warm-up is ``warmup_steps`` steps, or, when that is 0, ``ceil(warmup_ratio x total_steps)`` (kept
below ``total_steps``), as transformers' ``TrainingArguments`` counts it.

``scaled_lr(lr, global_batch, rule, base_batch)`` is the batch-size rule: ``linear`` (Goyal et al.
2017: lr x B / B0) or ``sqrt`` (lr x sqrt(B / B0), the rule for Adam-style optimizers in Malladi et
al. 2022); ``none`` leaves the LR alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from lightning_par import ConfigError

OPTIMIZERS = ("adamw", "adam", "sgd", "adamw8bit")
SCHEDULES = ("constant", "warmup_cosine", "warmup_linear")
LR_SCALING = ("none", "linear", "sqrt")


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.name!r}; choose from: {', '.join(OPTIMIZERS)}")
        if self.name == "adamw8bit":
            require_torchao()
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]


@dataclass
class ScheduleConfig:
    """The ``scheduler`` config group (``lightning_par/conf/scheduler/*.yaml``)."""

    name: str = "constant"
    warmup_steps: int = 0
    #: the warm-up as a share of ``total_steps``, used when ``warmup_steps`` is 0
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.0
    #: optimizer steps the decay spans; None: the trainer's estimate of the run's steps
    total_steps: int | None = None
    lr_scaling: str = "none"
    #: the global batch ``lr`` was tuned for (the reference of ``lr_scaling``)
    base_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ConfigError(f"unknown scheduler {self.name!r}; choose from: {', '.join(SCHEDULES)}")
        if self.lr_scaling not in LR_SCALING:
            raise ConfigError(f"unknown scheduler.lr_scaling {self.lr_scaling!r}; choose from: {', '.join(LR_SCALING)}")
        if self.lr_scaling != "none" and not self.base_batch_size:
            raise ConfigError(f"scheduler.lr_scaling={self.lr_scaling} needs scheduler.base_batch_size "
                              "(the global batch the configured lr was tuned for)")
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"scheduler: warmup_steps={self.warmup_steps} must be >= 0 and "
                              f"min_lr_ratio={self.min_lr_ratio} in [0, 1]")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"scheduler: warmup_ratio={self.warmup_ratio} must be in [0, 1)")

    def warmup_for(self, total_steps: int) -> int:
        """Warm-up steps of a run of ``total_steps``: ``warmup_steps``, else the ``warmup_ratio`` share
        (rounded up, at most ``total_steps - 1``)."""
        if self.warmup_steps or not self.warmup_ratio:
            return self.warmup_steps
        return max(0, min(math.ceil(self.warmup_ratio * total_steps), total_steps - 1))


def require_torchao() -> None:
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        raise ConfigError("optimizer adamw8bit needs torchao: pip install 'lightning_par[optim8bit]'") from None


def scaled_lr(lr: float, global_batch: int, rule: str = "none", base_batch: int | None = None) -> float:
    """The LR for ``global_batch`` samples per step, given ``lr`` tuned at ``base_batch``."""
    if rule == "none":
        return lr
    ratio = global_batch / float(base_batch)  # type: ignore[arg-type]
    return lr * (ratio if rule == "linear" else math.sqrt(ratio))


def multi_tensor_flags(params: list[torch.Tensor], cls: type) -> dict[str, bool]:
    """``fused=True`` when every parameter is a floating CUDA tensor (torch's fused kernels), else
    ``foreach=True`` (the multi-tensor path, which also runs on CPU and on DTensors)."""
    if not params:
        return {}
    on_cuda = all(p.device.type == "cuda" and p.is_floating_point() for p in params)
    if on_cuda and cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        return {"fused": True}
    return {"foreach": True}


def build_optimizer(params: Iterable[torch.Tensor], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if cfg.name == "adamw8bit":
        return _adamw8bit_class()(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                               **multi_tensor_flags(params, torch.optim.SGD))
    cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return cls(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, **multi_tensor_flags(params, cls))


def _adamw8bit_class() -> type:
    """torchao's ``AdamW8bit`` whose ``step`` also runs while a Python dispatch mode is active.

    torchao compiles its per-parameter update with ``torch.compile(fullgraph=True)``, and Dynamo
    refuses to trace under a user ``TorchDispatchMode`` (e.g. a callback that counts a few steps'
    collectives or FLOPs): the step would fail with "found no compiled frames". The update is local
    arithmetic on this rank's tensors (no collective), so it runs with those modes suspended (the
    closure, Lightning's forward and backward, still runs under them);
    torch offers no public API for that, hence the private ``_disable_current_modes``.

    Fake tensors (``FakeTensorMode``: the memory trace, ``costs/traced.py``) are refused: the compiled
    kernel is native code reading the tensors' data pointers, which fake tensors lack -- it segfaulted
    (issue 34) where it now raises. The trace runs ``costs.traced.AdamW8bitBytes`` in its place.
    """
    global _ADAMW8BIT
    if _ADAMW8BIT is None:
        from torch._subclasses.fake_tensor import is_fake
        from torch.utils._python_dispatch import _disable_current_modes
        from torchao.optim import AdamW8bit

        class LPAdamW8bit(AdamW8bit):
            def step(self, closure=None):  # noqa: ANN001, D102
                first = next((p for group in self.param_groups for p in group["params"]), None)
                if first is not None and is_fake(first):  # a fake step's parameters are all fake: one suffices
                    raise RuntimeError("AdamW8bit's step runs compiled native kernels, which cannot run on fake "
                                       "tensors; a memory trace runs lightning_par.costs.traced.AdamW8bitBytes")
                loss = None
                if closure is not None:  # Lightning's forward/backward: under the modes, as usual
                    with torch.enable_grad():
                        loss = closure()
                with _disable_current_modes():
                    super().step()
                return loss

        LPAdamW8bit.__name__ = LPAdamW8bit.__qualname__ = "AdamW8bit"
        _ADAMW8BIT = LPAdamW8bit
    return _ADAMW8BIT


_ADAMW8BIT: type | None = None


def lr_factor(step: int, cfg: ScheduleConfig, total_steps: int) -> float:
    """The multiplier of the base LR at optimizer step ``step`` (0-based)."""
    if cfg.name == "constant":
        return 1.0
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.name == "warmup_cosine" else 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR | None:
    """A per-step ``LambdaLR`` for ``cfg``; None for ``constant`` (nothing to step)."""
    if cfg.name == "constant":
        return None
    if total_steps is not None and total_steps > 0:
        cfg = dataclasses.replace(cfg, warmup_steps=cfg.warmup_for(total_steps), warmup_ratio=0.0)
    if total_steps is None or total_steps <= cfg.warmup_steps:
        raise ConfigError(f"scheduler {cfg.name}: total_steps={total_steps} must exceed "
                          f"warmup_steps={cfg.warmup_steps} (set trainer.max_steps or scheduler.total_steps)")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))


def schedule_config(node: object | None) -> ScheduleConfig:
    """``ScheduleConfig`` from the ``scheduler`` config node (a dict-like or None)."""
    if node is None:
        return ScheduleConfig()
    items = dict(node.items()) if hasattr(node, "items") else dict(node)  # type: ignore[call-overload]
    known = set(ScheduleConfig.__dataclass_fields__)
    unknown = sorted(set(items) - known)
    if unknown:
        raise ConfigError(f"scheduler: unknown keys {unknown}; known: {', '.join(sorted(known))}")
    return ScheduleConfig(**items)


def apply_schedule(model: object, node: object | None, global_batch_size: int | None) -> None:
    """Hand the ``scheduler`` config group and the global batch to a lightning_par model (``ParModule``).
    A model of the user's own chooses its schedule in its ``configure_optimizers``: a schedule other
    than the default is refused for it, in one line, rather than silently ignored."""
    schedule = schedule_config(node)
    set_schedule = getattr(model, "set_schedule", None)
    if callable(set_schedule):
        set_schedule(schedule, int(global_batch_size) if global_batch_size else None)
    elif schedule != ScheduleConfig():
        raise ConfigError(f"scheduler={schedule.name} (lr_scaling={schedule.lr_scaling}) applies to lightning_par's "
                          f"models; {type(model).__name__} sets its own schedule in configure_optimizers")


def per_tensor_where_mixed(optimizer: torch.optim.Optimizer) -> None:
    """torch's foreach kernels refuse a list mixing plain tensors and DTensors (or DTensors on
    different meshes, e.g. expert parallelism's experts beside tensor-parallel or FSDP shards): such
    parameter groups take the per-tensor path."""
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        kinds = {(p.device_mesh, tuple(p.placements)) if isinstance(p, DTensor) else None for p in group["params"]}
        if len(kinds) > 1 and "foreach" in group:
            group["foreach"] = False
