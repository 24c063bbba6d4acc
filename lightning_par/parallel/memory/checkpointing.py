"""Per-block activation checkpointing (torch's non-reentrant ``checkpoint_wrapper``), full or selective.

- ``full``: each named block keeps only its input during forward and recomputes all of its
  internals during backward (one extra forward of the block).
- ``selective``: torch's selective activation checkpointing (``create_selective_checkpoint_contexts``),
  with an op-level policy as torchtitan's: the outputs of the matmuls and of the fused attention
  kernels are saved, everything else (norms, activation functions, residual adds, dropout, the math
  attention's softmax) is recomputed. The matmuls are most of a block's FLOPs, the pointwise ops most of
  its saved bytes, so it keeps most of the memory saving for a small part of the recomputation.

- ``k`` (an integer >= 2): every k-th block checkpointed whole (blocks 0, k, 2k, ... of the model,
  torchtitan's layer-level selective checkpointing), the others keep everything: a k-th of full
  checkpointing's recomputation for a part of its saving.

The strategies' ``activation_checkpointing`` option takes false, true (= full), ``full``, ``selective``
or ``k`` (``checkpointing_mode``; 1 is full).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import cache, partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

#: what ``activation_checkpointing`` may be set to
MODES = ("full", "selective")


def checkpointing_mode(value: Any) -> str | int | None:
    """``activation_checkpointing``'s value as a mode: None (off), ``full``, ``selective`` or k >= 2 (every
    k-th block whole); true and 1 are full."""
    if value is None or value is False or value == "false":
        return None
    if value is True or value == "true":
        return "full"
    if value in MODES:
        return str(value)
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return "full" if value == 1 else value
    raise ValueError(f"activation_checkpointing must be false, true, full, selective or k >= 1 (every k-th block), "
                     f"got {value!r}")


def every_kth(blocks: Sequence[str], mode: str | int | None) -> list[str]:
    """The blocks (the whole model's, in order) that ``mode`` checkpoints: all of them, or for k every k-th
    (0, k, 2k, ...) -- chosen over the whole model, so a pipeline stage checkpoints its own of those."""
    if not mode:
        return []
    return [b for i, b in enumerate(blocks) if i % mode == 0] if isinstance(mode, int) else list(blocks)


def recomputed_moe_layers(n_layers: int, moe_every: int, mode: str | int | bool | None) -> int:
    """Routed MoE blocks (block i when (i + 1) % moe_every == 0) whose forward ``mode`` recomputes: every one
    under full or selective checkpointing (an all-to-all is not a matmul: selective recomputes it), those among
    blocks 0, k, 2k, ... for k."""
    if not mode:
        return 0
    picked = range(0, n_layers, mode) if type(mode) is int and mode >= 2 else range(n_layers)
    return sum(1 for i in picked if (i + 1) % moe_every == 0)


def checkpointed_share(n_layers: int, mode: str | int | bool | None) -> float:
    """The share of a model's ``n_layers`` blocks that ``mode`` checkpoints (0 off, 1 full / selective)."""
    if not mode:
        return 0.0
    if isinstance(mode, int) and not isinstance(mode, bool):
        return -(-n_layers // mode) / n_layers if n_layers else 0.0
    return 1.0


@cache
def _saved_ops() -> frozenset[Any]:
    """The ops whose outputs selective checkpointing keeps: matmuls and fused attention (those this torch has)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _policy(saved: frozenset[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Any:
    """A fresh pair of selective-checkpointing contexts (``checkpoint``'s ``context_fn``), one per call."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(partial(_policy, _saved_ops()))


def checkpointed_blocks(module: nn.Module) -> dict[str, int]:
    """The modules whose forward is checkpointed, counted by mode (``full`` / ``selective``): our wrappers,
    and the layers transformers checkpoints itself (its ``GradientCheckpointingLayer`` with checkpointing
    on) -- what was applied, read from the modules, not from the option."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    out: dict[str, int] = {}
    for m in module.modules():
        if isinstance(m, CheckpointWrapper):
            fn = m.checkpoint_fn
        elif getattr(m, "gradient_checkpointing", False) and any(
                c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__):
            fn = getattr(m, "_gradient_checkpointing_func", None)
        else:
            continue
        mode = "selective" if getattr(fn, "keywords", {}).get("context_fn") is selective_context else "full"
        out[mode] = out.get(mode, 0) + 1
    return out


def apply_activation_checkpointing(model: nn.Module, *, blocks: Iterable[str], mode: str = "full") -> int:
    """Wrap every module named in ``blocks`` (paths relative to ``model``) in place; returns the count.

    The wrapper keeps parameter names unchanged in ``state_dict`` (it strips its own prefix), so
    checkpoints move freely between runs with and without activation checkpointing.
    """
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: one of {', '.join(MODES)}")
    extra = {"context_fn": selective_context} if mode == "selective" else {}
    count = 0
    for path in blocks:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        child = parent.get_submodule(name)
        wrapped = checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra)
        if isinstance(parent, (nn.ModuleList, nn.Sequential)):
            parent[int(name)] = wrapped
        else:
            setattr(parent, name, wrapped)
        count += 1
    return count
