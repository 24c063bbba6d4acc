"""Memory-centric tiling (ZeRO-Infinity, Rajbhandari et al. 2021, section 5.1.3): a layer too large to
gather whole is split into tiles computed one after another.

Every large layer can be tiled: ``TiledLinear`` (any ``nn.Linear``: attention q/k/v/o, a fused qkv,
the MLP, the output head, in our GPT and in Hugging Face models alike), ``TiledConv1D`` (transformers'
``Conv1D``: GPT-2's fused c_attn, c_proj, c_fc, in column tiles) and ``TiledEmbedding`` (an
``nn.Embedding``: row tiles of the vocabulary).

A tied input embedding and output head (``tie_word_embeddings``: Llama-3.2-1B's 128256 x 2048 table,
GPT-2, Gemma, Qwen2 -- often the largest weight of the model) are tiled together, whichever of the two
paths is named (both: with one tile count): an embedding's vocabulary rows and a head
``nn.Linear(hidden, vocab)``'s output rows are the same rows of the shared weight, so the k row blocks
serve both. Tile i is one module (``VocabTile``) that both use -- looked up by the embedding, multiplied
by the head (``TiedHead``, whose ``tiles`` is the embedding's own ``ModuleList``) -- so the tie holds
by construction (one ``Parameter``), and under FSDP each block is one unit gathered at each use in
turn (a unit of the two tile modules, ``fully_shard([embedding tile, head tile])``, would stay
gathered from the embedding to the head: FSDP2 reshards a group of modules only when all have run,
so all k blocks would be held through the forward). Any other tie (three uses, two embeddings, a
module registered twice) is refused in one line, as are subclasses with their own ``forward``
(Gemma's scaled embedding: tiling would drop the scale).

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
``tile_sources``, so a tiled model starts from exactly the weights of the untiled one (a tied block
under its first name in the model, as the untiled tied weight is).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from lightning_par import ConfigError
from lightning_par.parallel.memory.chunked_loss import ChunkedHead

#: a tile's block of the untiled tensor: one slice per leading dimension (the rest whole)
Block = tuple[slice, ...]


def _keep_attributes(tiled: nn.Module, linear: nn.Linear) -> None:
    """Keep the attributes the model's own init rule reads (e.g. GPT's residual_projection)."""
    for key, value in vars(linear).items():
        if not key.startswith("_") and key not in ("in_features", "out_features", "training"):
            setattr(tiled, key, value)


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
        _keep_attributes(self, linear)

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


class _Lookup(torch.autograd.Function):
    """``F.embedding(ids, weight)`` that also takes ``anchor``, a float scalar, and gives it a zero
    gradient in the same backward node that gives ``weight`` its gradient. Why: FSDP2 frees a unit's
    gathered parameters and reduce-scatters their gradients when the gradients of the unit's inputs
    are computed; a lookup's only input, token ids, has none, so every embedding tile would stay
    gathered (with its full gradient) until the end of backward -- the whole table at once. With the
    anchor among the inputs, each tile is released as soon as its backward has run (the weight's
    gradient is accumulated first: autograd runs gradient accumulation as soon as it is ready)."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, anchor: torch.Tensor, padding_idx: int | None):
        ctx.save_for_backward(ids, anchor)
        ctx.rows, ctx.padding_idx = weight.shape[0], -1 if padding_idx is None else padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ids, anchor = ctx.saved_tensors
        weight_grad = torch.ops.aten.embedding_backward(grad, ids, ctx.rows, ctx.padding_idx, False, False)
        return None, weight_grad, torch.zeros_like(anchor), None


class VocabTile(nn.Embedding):
    """A ``TiledEmbedding``'s tile: a row block of the vocabulary, looked up by token ids (with an
    ``anchor``: see ``_Lookup``) -- and, when the embedding is tied to the output head, multiplied by
    hidden states for that block's logits (``project=True``, ``TiedHead``). One module for both uses,
    so the block is one FSDP unit gathered at each use in turn."""

    def forward(self, x: torch.Tensor, project: bool = False, anchor: torch.Tensor | None = None) -> torch.Tensor:
        if project:
            return F.linear(x, self.weight)
        if anchor is None:
            return super().forward(x)
        return _Lookup.apply(x, self.weight, anchor, self.padding_idx)


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
            self.tiles = nn.ModuleList(VocabTile(rows, dim, padding_idx=local_pad(i), dtype=embedding.weight.dtype)
                                       for i in range(tiles))
        if embedding.weight.device.type != "meta":
            with torch.no_grad():
                for i, tile in enumerate(self.tiles):
                    tile.weight.copy_(embedding.weight[i * rows:(i + 1) * rows])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = None
        # an input with a gradient, so that FSDP releases each tile after its backward (``_Lookup``)
        anchor = torch.zeros((), device=ids.device, requires_grad=True) if torch.is_grad_enabled() else None
        for i, tile in enumerate(self.tiles):
            local = ids - i * self.rows
            mine = (local >= 0) & (local < self.rows)
            part = tile(torch.where(mine, local, torch.zeros_like(local)), anchor=anchor) \
                * mine.unsqueeze(-1).to(tile.weight.dtype)
            out = part if out is None else out + part
        return out

    def tile_sources(self) -> dict[str, tuple[str, Block]]:
        """``tiles.i.weight -> (weight, its rows of the vocabulary)``."""
        return {f"tiles.{i}.weight": ("weight", (slice(i * self.rows, (i + 1) * self.rows),))
                for i in range(self.n_tiles)}


class TiedHead(nn.Module):
    """An output head ``nn.Linear(hidden, vocab)`` whose weight is a tiled embedding's: its ``tiles``
    are the embedding's (the same ``ModuleList``: head tile i's weight is embedding tile i's, one
    ``Parameter``), each projecting the hidden states onto its rows of the vocabulary, concatenated
    in turn. A bias, if the head has one, stays whole (it is not shared, and small)."""

    def __init__(self, linear: nn.Linear, embedding: TiledEmbedding) -> None:
        super().__init__()
        if tuple(linear.weight.shape) != (embedding.num_embeddings, embedding.embedding_dim):
            raise ConfigError(f"tiling: a head of weight {tuple(linear.weight.shape)} cannot share the tiles of an "
                              f"embedding of {embedding.num_embeddings} x {embedding.embedding_dim}")
        self.in_features, self.out_features, self.n_tiles = linear.in_features, linear.out_features, embedding.n_tiles
        self.tiles = embedding.tiles
        self.bias = linear.bias
        _keep_attributes(self, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([tile(x, project=True) for tile in self.tiles], dim=-1)
        return y if self.bias is None else y + self.bias

    def tile_sources(self) -> dict[str, tuple[str, Block]]:
        """``tiles.i.weight -> (weight, its rows of the untiled weight)``: the embedding's tiles under the
        head's names (materialisation fills a shared tile under its first name only)."""
        rows = self.out_features // self.n_tiles
        return {f"tiles.{i}.weight": ("weight", (slice(i * rows, (i + 1) * rows),)) for i in range(self.n_tiles)}


TILED = (TiledLinear, TiledEmbedding, TiledConv1D, TiedHead)


def _plain_kind(layer: nn.Module) -> type[nn.Module] | None:
    """``nn.Linear`` or ``nn.Embedding`` for such a layer computed by that class's own ``forward`` (a
    subclass overriding it, like Gemma's scaled embedding, computes something tiling would drop)."""
    for kind in (nn.Linear, nn.Embedding):
        if isinstance(layer, kind):
            return kind if type(layer).forward is kind.forward else None
    return None


def tileable(model: nn.Module, path: str, tiles: int) -> nn.Module:
    """The ``nn.Linear``, ``nn.Embedding`` or ``Conv1D`` at ``path`` if it can be cut into ``tiles``
    blocks (a tied embedding/head too: ``tied_partner``); else one line."""
    try:
        layer = model.get_submodule(path)
    except AttributeError:
        raise ConfigError(f"tiling: {type(model).__name__} has no module {path!r}") from None
    if not isinstance(layer, (nn.Linear, nn.Embedding)) and not _is_conv1d(layer):
        raise ConfigError(f"tiling: {path} is a {type(layer).__name__}; only nn.Linear, nn.Embedding and "
                          "transformers' Conv1D layers can be tiled")
    if isinstance(layer, ChunkedHead):  # both bound the output layer's memory; tiled, it is no longer one layer
        raise ConfigError(f"tiling: {path} is the output layer model.chunked_loss computes a chunk of tokens at a "
                          "time: use one of the two")
    if not _is_conv1d(layer) and _plain_kind(layer) is None:
        raise ConfigError(f"tiling: {path} is a {type(layer).__name__} with its own forward, which tiles would not "
                          "compute; only plain nn.Linear, nn.Embedding and transformers' Conv1D layers can be tiled")
    what = "out_features" if isinstance(layer, nn.Linear) else "num_embeddings" if isinstance(layer, nn.Embedding) \
        else "nf"
    rows = getattr(layer, what)
    if tiles < 2 or rows % tiles:
        raise ConfigError(f"tiling: {tiles} tiles must be >= 2 and divide {what}={rows} of {path}")
    tied_partner(model, path)
    return layer


def tied_partner(model: nn.Module, path: str) -> str | None:
    """The path of the module sharing ``path``'s weight, tiled with it in the same row blocks, or None.
    Only an ``nn.Embedding`` tied to an ``nn.Linear`` output head shares its blocks (the vocabulary
    rows of both); any other tie is one line (tiling one use would untie it)."""
    layer = model.get_submodule(path)
    weight = getattr(layer, "weight", None)
    others = [name for name, p in model.named_parameters(remove_duplicate=False)
              if p is weight and name != f"{path}.weight"]
    if not others:
        return None
    if len(others) > 1:
        raise ConfigError(f"tiling: {path}'s weight is also used by {' and '.join(others)}; tiling keeps a tie of "
                          "two (an embedding and its output head) only: tile another layer")
    owner, _, leaf = others[0].rpartition(".")
    partner = model.get_submodule(owner) if owner else model
    if partner is layer:
        raise ConfigError(f"tiling: {path} is also registered as {owner}; tiling would replace it at one place "
                          "only: tile another layer")
    if leaf != "weight" or {_plain_kind(layer), _plain_kind(partner)} != {nn.Linear, nn.Embedding}:
        raise ConfigError(f"tiling: {path}'s weight is tied to {others[0]}; only an nn.Embedding tied to an "
                          "nn.Linear output head is tiled together: tile another layer")
    return owner


def with_tied_partners(model: nn.Module, tiling: Mapping[str, int]) -> dict[str, int]:
    """``tiling`` with the tied partner of each layer it names at the same tile count (a tied embedding
    and head are tiled together); one line for a layer that cannot be tiled, or a tied pair named with
    two counts."""
    out = {path: int(k) for path, k in tiling.items()}
    for path, k in list(out.items()):
        tileable(model, path, k)
        partner = tied_partner(model, path)
        if partner is not None and out.setdefault(partner, k) != k:
            raise ConfigError(f"tiling: {path} and {partner} share one weight and are tiled together: give them "
                              f"the same tile count, not {k} and {out[partner]} (or name only one)")
    return out


def _replace(model: nn.Module, path: str, layer: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, name, layer)


def apply_tiling(model: nn.Module, tiling: Mapping[str, int]) -> list[str]:
    """Replace each layer named in ``tiling`` (path in ``model`` -> tile count), and the tied partner
    of one, by its tiled form; returns the tile paths, which become FSDP units (a tied pair's tile,
    one module, once: under its first path in the model)."""
    tiles: list[nn.Module] = []
    done: set[str] = set()
    for path, k in with_tied_partners(model, tiling).items():
        if path in done:
            continue
        layer, partner = model.get_submodule(path), tied_partner(model, path)
        if partner is not None:  # one set of VocabTiles for the embedding and the head
            emb_path, head_path = (path, partner) if isinstance(layer, nn.Embedding) else (partner, path)
            tiled = TiledEmbedding(model.get_submodule(emb_path), k)
            head = TiedHead(model.get_submodule(head_path), tiled)
            _replace(model, emb_path, tiled)
            _replace(model, head_path, head)
            done.add(partner)
        else:
            kind = TiledLinear if isinstance(layer, nn.Linear) else TiledEmbedding if isinstance(layer, nn.Embedding) \
                else TiledConv1D
            tiled = kind(layer, k)
            _replace(model, path, tiled)
        tiles += list(tiled.tiles)
    where = {id(m): p for p, m in model.named_modules()}
    return [where[id(t)] for t in tiles]


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
