"""Tied parameters: one ``Parameter`` used by two modules (a language model's input embedding and
output head). ``to_empty`` and per-module parameter replacement silently give each use its own
copy; ``materialize`` re-ties after allocating. Tensor parallelism keeps a tie by splitting both uses
alike (``tensor_parallel._retie_split``); pipeline stages keep a copy per stage, kept equal
(``pipeline/stage_ties.py``); a layout that can do neither is refused before it starts (``hf.plan.check_tied``).
Tiling keeps an embedding/head tie by sharing the tile modules themselves (``tiling.VocabTile``): a
module under two paths (``module_paths``), one FSDP unit."""

from __future__ import annotations

from torch import nn


def tied_parameters(model: nn.Module) -> list[tuple[str, str]]:
    """Pairs ``(first name, other name)`` of parameter names that share one ``Parameter`` object."""
    first: dict[int, str] = {}
    pairs = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            pairs.append((first[id(p)], name))
        else:
            first[id(p)] = name
    return pairs


def module_paths(model: nn.Module) -> dict[int, list[str]]:
    """Every path of each module (by id): more than one for a module registered under two parents
    (a tied embedding and head's shared tile, ``tiling.VocabTile``), which ``named_modules`` lists once."""
    out: dict[int, list[str]] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        out.setdefault(id(mod), []).append(path)
    return out


def retie(model: nn.Module, pairs: list[tuple[str, str]]) -> None:
    """Make every ``target`` parameter the ``source`` one again (after ``to_empty``, which unties)."""
    for src, dst in pairs:
        param = model.get_parameter(src)
        owner, _, leaf = dst.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf, param)
