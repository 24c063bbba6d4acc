"""Pretrained weights read shard by shard from a ``save_pretrained`` directory.

A model built on the meta device may declare ``contract.Pretrained(directory)`` (``pretrained_of``):
materialisation (``materialize.py``) then fills each rank's *local* tensors -- its FSDP shard, its
TP slice, its pipeline stage's layers, its tiles -- from the checkpoint's safetensors files instead
of the model's initialisation, reading only the slice the rank holds. No rank ever holds the full
model: a rank's setup peak is its shards plus at most one full tensor (only for a strided layout,
FSDP over a TP-split dimension, which is read whole and sliced by DTensor).

Reading uses safetensors' own lazy slicing (``safe_open(...).get_slice(key)[slices]``: the file is
memory-mapped and only the requested bytes are touched). ``torch.distributed.checkpoint``'s
Hugging Face reader would also do, but it plans a collective load of a whole state dict, while
materialisation fills one init group at a time, ranks independently.

Layer 1 (plain torch): every error is one line naming the path (``WeightsError``, a ``ConfigError``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_par import ConfigError

from lightning_par.parallel.contract import pretrained_of
from lightning_par.parallel.init.ties import tied_parameters

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class WeightsError(ConfigError):
    """A pretrained directory that cannot be read as asked (one line, naming the path)."""


class SafetensorsWeights:
    """The tensors of one ``save_pretrained`` directory: names, shapes, and slices read lazily."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        listed = _weight_files(self.directory)  # key -> file (the index's map; {"": file} without one)
        self._files: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(listed.values())):
            handle = _open(file)
            for key in handle.keys():
                self._shapes.setdefault(key, tuple(handle.get_slice(key).get_shape()))
                self._files.setdefault(key, file)
        missing = [k for k in listed if k and k not in self._shapes]
        if missing:
            raise WeightsError(f"{self.directory / INDEX_NAME}: lists {missing[0]} in {listed[missing[0]].name}, "
                               "which does not hold it")

    def __contains__(self, key: str) -> bool:
        return key in self._shapes

    def keys(self) -> Iterable[str]:
        return self._shapes.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """``key``'s tensor, or only ``index`` of it (one slice per leading dimension). The file is
        mapped for this read only: pages of a mapping count in the process's resident memory for as
        long as it stays open, so a rank that kept its files open would end up resident with every
        page it ever read -- about twice its shards -- instead of its shards alone."""
        handle = _open(self._files[key])
        try:
            return handle.get_slice(key)[index] if index else handle.get_tensor(key)
        except Exception as e:  # noqa: BLE001 - a truncated file fails here, not at open
            raise WeightsError(f"pretrained weights: cannot read {key} from {self._files[key]} ({e})") from None


class WeightRef:
    """One checkpoint tensor, read only where indexed: ``ref[()]`` is all of it, ``ref[slices]`` a block."""

    def __init__(self, weights: SafetensorsWeights, key: str) -> None:
        self.weights, self.key = weights, key
        self.shape = torch.Size(weights.shape(key))

    def __getitem__(self, index: tuple[slice, ...] | slice) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        return self.weights.read(self.key, index)


class MergedRef(WeightRef):
    """A model tensor that the checkpoint stores in pieces, as transformers' own loader converts it
    (``transformers.conversion_mapping``: an MoE checkpoint keeps one tensor per expert and
    projection, ``experts.<i>.w1.weight``, where the model holds ``experts.gate_up_proj`` of every
    expert): ``pieces`` per source pattern, stacked along ``stack`` (``MergeModulelist``), the
    stacks concatenated along ``concat`` (``Concatenate``). Indexing reads only the experts asked for
    along the stacked dimension (an FSDP or expert-parallel shard), then slices the rest."""

    def __init__(self, weights: SafetensorsWeights, pieces: list[list[str]], stack: int, concat: int | None) -> None:
        self.weights, self.pieces, self.stack, self.concat = weights, pieces, stack, concat
        self.key = " + ".join(keys[0].replace(".0.", ".*.", 1) if len(keys) > 1 else keys[0] for keys in pieces)
        one = weights.shape(pieces[0][0])
        shape = [*one[:stack], len(pieces[0]), *one[stack:]]
        if concat is not None:
            shape[concat] = sum([*weights.shape(keys[0])[:stack], len(keys), *weights.shape(keys[0])[stack:]][concat]
                                for keys in pieces)
        self.shape = torch.Size(shape)

    def __getitem__(self, index: tuple[slice, ...] | slice) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        picked = index[0] if self.stack == 0 and index else slice(None)
        parts = [torch.stack([self.weights.read(k) for k in keys[picked]], dim=self.stack) for keys in self.pieces]
        whole = parts[0] if self.concat is None else torch.cat(parts, dim=self.concat)
        rest = index[1:] if self.stack == 0 and index else index
        return whole[(slice(None), *rest)] if rest else whole


class WeightSources:
    """Every pretrained declaration of a model (``contract.pretrained_of``), opened, with the tied
    names (a tied head is saved once, under the name it shares) -- taken before any technique."""

    def __init__(self, sources: Mapping[str, SafetensorsWeights], aliases: Mapping[str, str],
                 conversions: Mapping[str, list[Any]] | None = None) -> None:
        self.sources = dict(sources)  # module path prefix ("" or "net.") -> its checkpoint
        self.aliases = dict(aliases)  # full tensor name -> the full name it shares a Parameter with
        self.conversions = dict(conversions or {})  # prefix -> transformers' weight conversions of that model

    def find(self, name: str) -> WeightRef | None:
        """The checkpoint tensor for the model's tensor ``name`` (canonical, full path), or None."""
        for candidate in (name, self.aliases.get(name)):
            for prefix, weights in self.sources.items():
                if candidate is None or not candidate.startswith(prefix):
                    continue
                local = candidate[len(prefix):]
                if local in weights:
                    return WeightRef(weights, local)
                ref = _converted(local, weights, self.conversions.get(prefix) or [])
                if ref is not None:
                    return ref
        return None


def _renamed_back(name: str, conversions: list[Any]) -> list[str]:
    """``name`` and what the checkpoint may call it under transformers' plain renamings (a target
    string replaced by its source: ``.mlp.`` -> ``.block_sparse_moe.``); regex renamings are skipped."""
    out = [name]
    for c in conversions:
        if type(c).__name__ != "WeightRenaming":
            continue
        sources, targets = c._original_source_patterns, c._original_target_patterns
        for src, tgt in zip(sources if isinstance(sources, list) else [sources],
                            targets if isinstance(targets, list) else [targets]):
            if not any(ch in src + tgt for ch in "()[]?*+^$\\|") and tgt in name:
                out.append(name.replace(tgt, src))
    return out


def _converted(name: str, weights: SafetensorsWeights, conversions: list[Any]) -> WeightRef | None:
    """The checkpoint tensor(s) transformers' conversions make ``name`` from, or None (a renamed
    tensor; a merge of per-expert tensors, stacked and concatenated; any other operation: None)."""
    for candidate in _renamed_back(name, conversions)[1:]:
        if candidate in weights:
            return WeightRef(weights, candidate)
    for c in conversions:
        if type(c).__name__ != "WeightConverter":
            continue
        targets = c._original_target_patterns
        targets = targets if isinstance(targets, list) else [targets]
        if len(targets) != 1 or not name.endswith(targets[0]):
            continue
        ops = [type(op).__name__ for op in c.operations]
        if ops not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]):
            return None
        stack = c.operations[0].dim
        concat = c.operations[1].dim if len(ops) == 2 else None
        sources = c._original_source_patterns
        for full in _renamed_back(name, conversions):  # renamed as whole names: ".mlp." needs its dots
            prefix = full[: -len(targets[0])]
            pieces = []
            for pattern in sources if isinstance(sources, list) else [sources]:
                head, _, tail = (prefix + pattern).partition("*")
                keys, i = [], 0
                while f"{head}{i}{tail}" in weights:
                    keys.append(f"{head}{i}{tail}")
                    i += 1
                pieces.append(keys)
            if all(pieces) and len({len(k) for k in pieces}) == 1:
                return MergedRef(weights, pieces, stack, concat)
    return None

    def __bool__(self) -> bool:
        return bool(self.sources)


def weight_sources(module: torch.nn.Module) -> WeightSources | None:
    """The pretrained checkpoints ``module`` declares, opened (None if it declares none). Call it
    before any technique: tensor names are then the plain module paths."""
    declared = pretrained_of(module)
    if not declared:
        return None
    sources = {(f"{path}." if path else ""): SafetensorsWeights(p.directory) for path, p in declared.items()}
    aliases = {}
    for first, other in tied_parameters(module):
        aliases[other] = first
        aliases.setdefault(first, other)
    return WeightSources(sources, aliases, {(f"{path}." if path else ""): _conversions(module.get_submodule(path))
                                            for path in declared})


def _conversions(net: torch.nn.Module) -> list[Any]:
    """transformers' checkpoint conversions for ``net`` (its class, else its ``model_type``): how a
    checkpoint's tensor names and pieces become the model's; none for other models."""
    try:
        from transformers.conversion_mapping import extract_weight_conversions_for_model
    except ImportError:
        return []
    try:
        return list(extract_weight_conversions_for_model(net) or [])
    except Exception:  # noqa: BLE001 - not a transformers model
        return []


def check_pretrained(net: torch.nn.Module, weights: SafetensorsWeights) -> None:
    """One line unless ``weights`` holds every parameter of the (meta) model ``net`` in its shape."""
    params = {name: tuple(p.shape) for name, p in net.named_parameters()}  # a tied one under its first name
    aliases = {other: first for first, other in tied_parameters(net)}
    check_weights(params, weights, aliases, optional=[name for name, _ in net.named_buffers()],
                  conversions=_conversions(net))


def _open(file: Path) -> object:
    """A safetensors handle of ``file`` (header parsed, data memory-mapped); one line if unreadable."""
    from safetensors import safe_open

    if not file.is_file():
        raise WeightsError(f"pretrained weights: shard file {file} is missing")
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WeightsError(f"pretrained weights: {file} is not a readable safetensors file ({first})") from None


def _weight_files(directory: Path) -> dict[str, Path]:
    """Key -> safetensors file of a ``save_pretrained`` directory (one line if it is not one)."""
    if not directory.is_dir():
        raise WeightsError(f"pretrained weights: {directory} is not a directory")
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, Mapping)
        except (ValueError, KeyError, AssertionError):
            raise WeightsError(f"pretrained weights: {index} is not a safetensors index (no weight_map)") from None
        return {str(k): directory / str(v) for k, v in weight_map.items()}
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return {"": single}  # keys come from the file itself
    others = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
    hint = f" (found {others[0]}: re-save it with save_pretrained(safe_serialization=True))" if others else ""
    raise WeightsError(f"pretrained weights: {directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME}{hint}")


def check_weights(expected: Mapping[str, tuple[int, ...]], weights: SafetensorsWeights,
                  aliases: Mapping[str, str] | None = None, optional: Iterable[str] = (),
                  conversions: list[Any] | None = None) -> None:
    """One line if ``weights`` cannot fill a model whose parameters are ``expected`` (name -> shape): a
    parameter it lacks (a tied one may be saved under either name: ``aliases`` maps one to the
    other; a converted one under transformers' checkpoint names, ``conversions``), one of another
    shape, or a tensor the model has no place for (another architecture's checkpoint). ``optional``
    names tensors it may hold or not (buffers: their init makes them)."""
    partner = dict(aliases or {})
    partner.update({v: k for k, v in partner.items()})
    found = WeightSources({"": weights}, partner, {"": list(conversions or [])})
    used: set[str] = set()
    for key, shape in expected.items():
        ref = found.find(key)
        if ref is None:
            raise WeightsError(f"pretrained weights: {weights.directory} has no tensor {key} "
                               "(a checkpoint of another architecture or size?)")
        if tuple(ref.shape) != tuple(shape):
            raise WeightsError(f"pretrained weights: {weights.directory}: {ref.key} has shape "
                               f"{tuple(ref.shape)}, the model's config gives {tuple(shape)}")
        used.update(_keys_of(ref))
    for name in optional:
        ref = found.find(name)
        used.update(_keys_of(ref) if ref is not None else [name])
    unused = [k for k in weights.keys() if k not in used]
    if unused:
        raise WeightsError(f"pretrained weights: {weights.directory} holds {unused[0]} (and {len(unused) - 1} more), "
                           "which the model built from its config.json does not have")


def _keys_of(ref: WeightRef) -> list[str]:
    return [k for keys in ref.pieces for k in keys] if isinstance(ref, MergedRef) else [ref.key]


__all__ = ["INDEX_NAME", "WEIGHTS_NAME", "MergedRef", "SafetensorsWeights", "WeightRef", "WeightSources",
           "WeightsError", "check_pretrained", "check_weights", "weight_sources"]
