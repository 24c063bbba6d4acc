"""Cutting a model into pipeline stages inside its LightningModule (plain torch).

A pipeline rank keeps the layers of its stages; every other layer of the model's declared
``layers`` is replaced by a parameter-free ``RemoteLayer``, so ``configure_optimizers``, the
module's ``state_dict`` and the materialisation of a meta-device model see only this rank's part,
under the full model's names. Where to cut: explicit split points, or balanced costs (parameter
counts, or measured forward + backward time per layer).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_par.parallel.contract import StageRunnerFactory


class RemoteLayer(nn.Module):
    """Stands in, inside this rank's LightningModule, for a layer that lives on another pipeline rank.

    It keeps the layer's plain attributes (strings, numbers, flags such as a decoder layer's
    ``attention_type``): a model's forward, which a Hugging Face stage runs, may read them."""

    def __init__(self, path: str, stage: int, attrs: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.path, self.stage = path, stage
        self._lp_attrs = dict(attrs or {})

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            attrs = self.__dict__.get("_lp_attrs", {})
            if name in attrs:
                return attrs[name]
            raise

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"layer {self.path!r} lives on pipeline stage {self.stage} (another rank); "
                           "run the model through the pipeline strategy's training/validation step")

    def extra_repr(self) -> str:
        return f"{self.path} -> stage {self.stage}"


def _replace_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    parent._modules[leaf] = new


def n_stage_starts(layers: Sequence[str], starts: Sequence[int] = ()) -> int:
    """How many layers a stage may start at: the most stages ``layers`` can be cut into."""
    return len(starts) if starts else len(layers)


def check_stage_starts(layers: Sequence[str], bounds: Sequence[int], starts: Sequence[int] = ()) -> None:
    """One-line ``ValueError`` when a stage of ``bounds`` starts at a layer outside ``starts``
    (``ParallelPlan.stage_starts``; () = any layer)."""
    if not starts:
        return
    allowed = set(starts)
    for b in bounds[1:-1]:
        if b not in allowed:
            ok = ", ".join(layers[i] for i in sorted(allowed) if i)
            raise ValueError(f"pipeline: a stage cannot start at {layers[b]!r}: the model's forward does not pass it "
                             f"the previous layer's output (it would compute a wrong model); stages may start at: {ok}")


def resolve_split_points(layers: Sequence[str], split_points: Sequence[int | str], n_stages: int,
                         starts: Sequence[int] = ()) -> list[int]:
    """Stage boundaries ``[0, ..., len(layers)]`` from split points: the first layer of every stage
    after the first, as an index into ``layers`` or a layer path (``net.blocks.4``; the unique layer
    ending in ``.blocks.4`` also matches ``blocks.4``). A stage starting outside ``starts``
    (``ParallelPlan.stage_starts``) is refused in one line."""
    layers = list(layers)
    cuts = []
    for point in split_points:
        if isinstance(point, int) and not isinstance(point, bool):
            cuts.append(point)
            continue
        name = str(point)
        matches = [i for i, path in enumerate(layers) if path == name] or \
                  [i for i, path in enumerate(layers) if path.endswith("." + name)]
        if len(matches) != 1:
            raise ValueError(f"split point {name!r} is not one of the model's layers ({', '.join(layers)})")
        cuts.append(matches[0])
    if len(cuts) != n_stages - 1:
        raise ValueError(f"split_points: {n_stages} pipeline stages need {n_stages - 1} split points, got {len(cuts)}")
    bounds = [0, *cuts, len(layers)]
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"split_points must be increasing layer indices between 1 and {len(layers) - 1}, got {cuts}")
    check_stage_starts(layers, bounds, starts)
    return bounds


def measure_layer_times(module: nn.Module, layers: Sequence[str], example: torch.Tensor,
                        repeats: int = 3, starts: Sequence[int] = (),
                        stage_runner: StageRunnerFactory | None = None) -> list[float]:
    """Seconds of forward + backward of every layer on ``example`` (median of ``repeats`` runs after a
    warm-up), layer by layer: the costs for a compute-balanced pipeline cut. A Hugging Face model's
    layer runs as a one-layer stage would, through the model's own forward (``hf.stages``). With
    ``starts`` (``ParallelPlan.stage_starts``) the layers from one start to the next run as one stage
    (nothing else would be correct), their time counted on the first of them (0 on the others)."""
    edges = [*(sorted(starts) if starts else range(len(layers))), len(layers)]
    groups = list(zip(edges, edges[1:]))
    runners = [(stage_runner or (lambda *_: None))(module, layers, a, b) for a, b in groups]
    times: list[list[float]] = [[] for _ in groups]
    sync = torch.cuda.synchronize if example.device.type == "cuda" else (lambda: None)
    for run in range(repeats + 1):
        h = example
        for g, (a, b) in enumerate(groups):
            x = h.detach().requires_grad_() if h.is_floating_point() else h
            sync()
            start = time.perf_counter()
            runner = runners[g]
            if runner is not None:
                out = runner(x, module.get_submodule)
            else:
                out = x
                for path in layers[a:b]:
                    out = module.get_submodule(path)(out)
            out.float().sum().backward()
            sync()
            if run:
                times[g].append(time.perf_counter() - start)
            h = out.detach()
    module.zero_grad(set_to_none=True)
    costs = [0.0] * len(layers)
    for (a, _), t in zip(groups, times):
        costs[a] = statistics.median(t)
    return costs




def drop_remote_layers(module: nn.Module, layers: Sequence[str], local: set[str], owner: dict[str, int]) -> None:
    """Replace every layer in ``layers`` that is not in ``local`` by a ``RemoteLayer`` naming its stage."""
    for path in layers:
        if path not in local:
            layer = module.get_submodule(path)
            attrs = {k: v for k, v in vars(layer).items()
                     if not k.startswith("_") and k != "training" and isinstance(v, (str, int, float, bool))}
            _replace_submodule(module, path, RemoteLayer(path, owner[path], attrs))
