"""Per-block activation checkpointing: each named block keeps only its input during forward and
recomputes its internals during backward (torch's non-reentrant ``checkpoint_wrapper``)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper


def apply_activation_checkpointing(model: nn.Module, *, blocks: Iterable[str]) -> int:
    """Wrap every module named in ``blocks`` (paths relative to ``model``) in place; returns the count.

    The wrapper keeps parameter names unchanged in ``state_dict`` (it strips its own prefix), so
    checkpoints move freely between runs with and without activation checkpointing.
    """
    count = 0
    for path in blocks:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        child = parent.get_submodule(name)
        wrapped = checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        if isinstance(parent, (nn.ModuleList, nn.Sequential)):
            parent[int(name)] = wrapped
        else:
            setattr(parent, name, wrapped)
        count += 1
    return count
