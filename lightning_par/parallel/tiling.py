"""Memory-centric tiling (ZeRO-Infinity, Rajbhandari et al. 2021, section 5.1.3): a layer too large to
gather whole is split into tiles computed one after another.

Every large layer can be tiled: ``TiledLinear`` (any ``nn.Linear``: attention q/k/v/o, a fused qkv,
the MLP, the output head, in our GPT and in Hugging Face models alike), ``TiledConv1D`` (transformers'
``Conv1D``: GPT-2's fused c_attn, c_proj, c_fc, in column tiles) and ``TiledEmbedding`` (an
``nn.Embedding``: row tiles of the vocabulary). A weight tied to another module's is refused (tiling
would untie it).

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

#: a tile's block of the untiled tensor: one slice per leading dimension (the rest whole)
Block = tuple[slice, ...]


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

    def tile_sources(self) -> dict[str, tuple[str, Block]]:
        """``tiles.i.weight -> (weight, its rows of the untiled weight)`` (bias likewise)."""
        rows = self.out_features // self.n_tiles
        out = {}
        for i, tile in enumerate(self.tiles):
            for name, _ in tile.named_parameters():
                out[f"tiles.{i}.{name}"] = (name, (slice(i * rows, (i + 1) * rows),))
        return out


def _is_conv1d(layer: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's c_attn, c_proj, c_fc), recognised without importing transformers."""
    return type(layer).__name__ == "Conv1D" and hasattr(layer, "nf") and hasattr(layer, "nx")


class TiledConv1D(nn.Module):
    """transformers' ``Conv1D`` (``y = x W + b``, ``W`` of shape (in, out): a transposed linear) as
    ``tiles`` column blocks of ``W`` (output features), computed one after another. GPT-2's fused
    c_attn is cut along its concatenated q|k|v outputs: the same function, whatever the cut."""

    def __init__(self, conv: nn.Module, tiles: int) -> None:
        super().__init__()
        inp, out = conv.weight.shape
        if tiles < 2 or out % tiles:
            raise ConfigError(f"tiling: {tiles} tiles must be >= 2 and divide nf={out}")
        self.nx, self.nf, self.n_tiles = inp, out, tiles
        cols = out // tiles
        with torch.device(conv.weight.device):
            self.tiles = nn.ModuleList(type(conv)(cols, inp).to(conv.weight.dtype) for _ in range(tiles))
        if conv.weight.device.type != "meta":
            with torch.no_grad():
                for i, tile in enumerate(self.tiles):
                    tile.weight.copy_(conv.weight[:, i * cols:(i + 1) * cols])
                    tile.bias.copy_(conv.bias[i * cols:(i + 1) * cols])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([tile(x) for tile in self.tiles], dim=-1)

    def tile_sources(self) -> dict[str, tuple[str, Block]]:
        """``tiles.i.weight -> (weight, all its rows, its columns)``; ``tiles.i.bias -> (bias, its columns)``."""
        cols = self.nf // self.n_tiles
        out = {}
        for i in range(self.n_tiles):
            mine = slice(i * cols, (i + 1) * cols)
            out[f"tiles.{i}.weight"] = ("weight", (slice(0, self.nx), mine))
            out[f"tiles.{i}.bias"] = ("bias", (mine,))
        return out


class TiledEmbedding(nn.Module):
    """``nn.Embedding`` as ``tiles`` row blocks of the vocabulary, looked up one after another: each
    tile embeds the tokens in its rows (the others read row 0 and are multiplied by 0), and the
    tiles' outputs are summed -- every token gets exactly its row, and only its tile's row gets a
    gradient. ``padding_idx`` stays with the tile that holds it."""

    def __init__(self, embedding: nn.Embedding, tiles: int) -> None:
        super().__init__()
        vocab, dim = embedding.weight.shape
        if tiles < 2 or vocab % tiles:
            raise ConfigError(f"tiling: {tiles} tiles must be >= 2 and divide num_embeddings={vocab}")
        if embedding.max_norm is not None or embedding.sparse:
            raise ConfigError("tiling: an nn.Embedding with max_norm or sparse gradients cannot be tiled")
        self.num_embeddings, self.embedding_dim, self.n_tiles = vocab, dim, tiles
        self.rows = rows = vocab // tiles
        pad = embedding.padding_idx

        def local_pad(i: int) -> int | None:
            return pad - i * rows if pad is not None and i * rows <= pad < (i + 1) * rows else None

        with torch.device(embedding.weight.device):
            self.tiles = nn.ModuleList(nn.Embedding(rows, dim, padding_idx=local_pad(i), dtype=embedding.weight.dtype)
                                       for i in range(tiles))
        if embedding.weight.device.type != "meta":
            with torch.no_grad():
                for i, tile in enumerate(self.tiles):
                    tile.weight.copy_(embedding.weight[i * rows:(i + 1) * rows])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = None
        for i, tile in enumerate(self.tiles):
            local = ids - i * self.rows
            mine = (local >= 0) & (local < self.rows)
            part = tile(torch.where(mine, local, torch.zeros_like(local))) * mine.unsqueeze(-1).to(tile.weight.dtype)
            out = part if out is None else out + part
        return out

    def tile_sources(self) -> dict[str, tuple[str, Block]]:
        """``tiles.i.weight -> (weight, its rows of the vocabulary)``."""
        return {f"tiles.{i}.weight": ("weight", (slice(i * self.rows, (i + 1) * self.rows),))
                for i in range(self.n_tiles)}


TILED = (TiledLinear, TiledEmbedding, TiledConv1D)


def tileable(model: nn.Module, path: str, tiles: int) -> nn.Module:
    """The ``nn.Linear`` or ``nn.Embedding`` at ``path`` if it can be cut into ``tiles`` row blocks;
    else one line."""
    from lightning_par.parallel.ties import tied_parameters

    try:
        layer = model.get_submodule(path)
    except AttributeError:
        raise ConfigError(f"tiling: {type(model).__name__} has no module {path!r}") from None
    if not isinstance(layer, (nn.Linear, nn.Embedding)) and not _is_conv1d(layer):
        raise ConfigError(f"tiling: {path} is a {type(layer).__name__}; only nn.Linear, nn.Embedding and "
                          "transformers' Conv1D layers can be tiled")
    what = "out_features" if isinstance(layer, nn.Linear) else "num_embeddings" if isinstance(layer, nn.Embedding) \
        else "nf"
    rows = getattr(layer, what)
    if tiles < 2 or rows % tiles:
        raise ConfigError(f"tiling: {tiles} tiles must be >= 2 and divide {what}={rows} of {path}")
    for a, b in tied_parameters(model):
        if f"{path}.weight" in (a, b):
            raise ConfigError(f"tiling: {path}'s weight is tied to {b if a == f'{path}.weight' else a}; tiling would "
                              "untie them: tile another layer")
    return layer


def apply_tiling(model: nn.Module, tiling: Mapping[str, int]) -> list[str]:
    """Replace each layer named in ``tiling`` (path in ``model`` -> tile count) by a ``TiledLinear``
    or ``TiledEmbedding``; returns the tile paths (in model order), which become FSDP units."""
    paths = []
    for path, k in tiling.items():
        layer = tileable(model, path, int(k))
        parent_path, _, name = path.rpartition(".")
        kind = TiledLinear if isinstance(layer, nn.Linear) else TiledEmbedding if isinstance(layer, nn.Embedding) \
            else TiledConv1D
        tiled = kind(layer, int(k))
        setattr(model.get_submodule(parent_path) if parent_path else model, name, tiled)
        paths += [f"{path}.tiles.{i}" for i in range(int(k))]
    return paths


def tile_sources(model: nn.Module, canonical: object = str) -> dict[str, list[tuple[str, Block]]]:
    """For materialisation: the untiled parameter name -> [(tile parameter name, its block)], names as
    ``canonical`` (a function) writes them."""
    out: dict[str, list[tuple[str, Block]]] = {}
    for path, mod in model.named_modules():
        if isinstance(mod, TILED):
            prefix = canonical(path)  # type: ignore[operator]
            for piece, (full, block) in mod.tile_sources().items():
                out.setdefault(f"{prefix}.{full}", []).append((f"{prefix}.{piece}", block))
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
