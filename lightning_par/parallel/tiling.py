"""Memory-centric tiling (ZeRO-Infinity, Rajbhandari et al. 2021, section 5.1.3): a layer too large to
gather whole is split into tiles computed one after another.

``TiledLinear`` replaces an ``nn.Linear(in, out)`` by ``k`` linears of ``out / k`` output features
each (row blocks of the weight ``W = [W_1; ...; W_k]``, the bias likewise), applied in turn and
concatenated along the last dimension::

    y = x W^T + b = [x W_1^T + b_1, ..., x W_k^T + b_k]

The result is the same function with the same parameter values (``W_i`` is rows ``i*out/k ..
(i+1)*out/k - 1`` of ``W``). ``parallelize`` checkpoints each tile (**checkpoint activations**) and
makes it an FSDP unit of its own (**fully shard**), so under FSDP a tile's all-gather, compute and
free happen one tile at a time: the largest unit gathered shrinks from the whole layer to 1/k of it
(plus FSDP's prefetch of the next unit). Activation memory is not reduced (the concatenated output
is the layer's full output).

Materialisation (``materialize.py``) fills each tile from the untiled layer's initialisation via
``tile_sources``, so a tiled model starts from exactly the weights of the untiled one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lightning_par import ConfigError


class TiledLinear(nn.Module):
    """``nn.Linear`` as ``tiles`` row blocks (output features), computed one after another."""

    def __init__(self, linear: nn.Linear, tiles: int) -> None:
        super().__init__()
        out, inp = linear.weight.shape
        if tiles < 2 or out % tiles:
            raise ConfigError(f"tiling: {tiles} tiles must be >= 2 and divide out_features={out}")
        self.in_features, self.out_features, self.n_tiles = inp, out, tiles
        rows = out // tiles
        with torch.device(linear.weight.device):
            self.tiles = nn.ModuleList(nn.Linear(inp, rows, bias=linear.bias is not None, dtype=linear.weight.dtype)
                                       for _ in range(tiles))
        if linear.weight.device.type != "meta":  # real weights: copy the row blocks
            with torch.no_grad():
                for i, tile in enumerate(self.tiles):
                    tile.weight.copy_(linear.weight[i * rows:(i + 1) * rows])
                    if tile.bias is not None:
                        tile.bias.copy_(linear.bias[i * rows:(i + 1) * rows])
        # keep the attributes the model's own init rule reads (e.g. GPT's residual_projection)
        for key, value in vars(linear).items():
            if not key.startswith("_") and key not in ("in_features", "out_features", "training"):
                setattr(self, key, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([tile(x) for tile in self.tiles], dim=-1)

    def tile_sources(self) -> dict[str, tuple[str, slice]]:
        """``tiles.i.weight -> (weight, rows of the untiled weight)`` (bias likewise)."""
        rows = self.out_features // self.n_tiles
        out = {}
        for i, tile in enumerate(self.tiles):
            for name, _ in tile.named_parameters():
                out[f"tiles.{i}.{name}"] = (name, slice(i * rows, (i + 1) * rows))
        return out


def tileable(model: nn.Module, path: str, tiles: int) -> nn.Linear:
    """The ``nn.Linear`` at ``path`` if it can be cut into ``tiles`` row blocks; else one line."""
    try:
        layer = model.get_submodule(path)
    except AttributeError:
        raise ConfigError(f"tiling: {type(model).__name__} has no module {path!r}") from None
    if not isinstance(layer, nn.Linear):
        raise ConfigError(f"tiling: {path} is a {type(layer).__name__}; only nn.Linear layers can be tiled")
    if tiles < 2 or layer.out_features % tiles:
        raise ConfigError(f"tiling: {tiles} tiles must be >= 2 and divide out_features={layer.out_features}")
    return layer


def apply_tiling(model: nn.Module, tiling: Mapping[str, int]) -> list[str]:
    """Replace each ``nn.Linear`` named in ``tiling`` (path in ``model`` -> tile count) by a
    ``TiledLinear``; returns the tile paths (in model order), which become FSDP units."""
    paths = []
    for path, k in tiling.items():
        layer = tileable(model, path, int(k))
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, name, TiledLinear(layer, int(k)))
        paths += [f"{path}.tiles.{i}" for i in range(int(k))]
    return paths


def tile_sources(model: nn.Module, canonical: object = str) -> dict[str, list[tuple[str, slice]]]:
    """For materialisation: the untiled parameter name -> [(tile parameter name, rows)], names as
    ``canonical`` (a function) writes them."""
    out: dict[str, list[tuple[str, slice]]] = {}
    for path, mod in model.named_modules():
        if isinstance(mod, TiledLinear):
            prefix = canonical(path)  # type: ignore[operator]
            for piece, (full, rows) in mod.tile_sources().items():
                out.setdefault(f"{prefix}.{full}", []).append((f"{prefix}.{piece}", rows))
    return out


def check_tiling(tiling: Mapping[str, int] | None, tp_plan: Mapping[str, object] | None = None) -> dict[str, int]:
    """The ``tiling`` option as ``{path: tiles}``; one line for bad input (including a layer that
    the tensor-parallel plan also splits: tiles and TP shards of one layer are not combined)."""
    if not tiling:
        return {}
    if not isinstance(tiling, Mapping):
        raise ConfigError(f"strategy.tiling={tiling!r}: expected {{module path: tiles}}, e.g. {{net.head.lm_head: 4}}")
    out = {}
    for path, k in tiling.items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 2:
            raise ConfigError(f"strategy.tiling: {path}={k!r} must be an integer number of tiles >= 2")
        if tp_plan and any(path == p or path.endswith("." + p) or p.endswith("." + path) for p in tp_plan):
            raise ConfigError(f"strategy.tiling: {path} is also split by tensor parallelism; tile another layer")
        out[str(path)] = k
    return out


def largest_units(model: nn.Module) -> dict[str, int]:
    """Bytes each FSDP unit all-gathers (its own parameters at full size, nested units excluded),
    by unit path (``""``: the root). A measurement of the layout, for the README's tiling figures."""
    from torch.distributed.fsdp import FSDPModule

    owner: dict[int, str] = {}
    sizes: dict[str, int] = {}
    for path, mod in model.named_modules():  # parents before children: the deepest unit wins
        if isinstance(mod, FSDPModule):
            sizes[path] = 0
            for p in mod.parameters():
                owner[id(p)] = path
    for p in model.parameters():
        if id(p) in owner:
            sizes[owner[id(p)]] += p.numel() * p.element_size()  # a DTensor's numel is the full size
    return sizes
