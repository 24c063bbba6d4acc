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

import contextvars
import json
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightning_par import ConfigError

from lightning_par.parallel.contract import mark_pretrained, pretrained_of
from lightning_par.parallel.ties import tied_parameters

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


class WeightSources:
    """Every pretrained declaration of a model (``contract.pretrained_of``), opened, with the tied
    names (a tied head is saved once, under the name it shares) -- taken before any technique."""

    def __init__(self, sources: Mapping[str, SafetensorsWeights], aliases: Mapping[str, str]) -> None:
        self.sources = dict(sources)  # module path prefix ("" or "net.") -> its checkpoint
        self.aliases = dict(aliases)  # full tensor name -> the full name it shares a Parameter with

    def find(self, name: str) -> WeightRef | None:
        """The checkpoint tensor for the model's tensor ``name`` (canonical, full path), or None."""
        for candidate in (name, self.aliases.get(name)):
            for prefix, weights in self.sources.items():
                if candidate is not None and candidate.startswith(prefix) and candidate[len(prefix):] in weights:
                    return WeightRef(weights, candidate[len(prefix):])
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
    return WeightSources(sources, aliases)


def check_pretrained(net: torch.nn.Module, weights: SafetensorsWeights) -> None:
    """One line unless ``weights`` holds every parameter of the (meta) model ``net`` in its shape."""
    params = {name: tuple(p.shape) for name, p in net.named_parameters()}  # a tied one under its first name
    aliases = {other: first for first, other in tied_parameters(net)}
    check_weights(params, weights, aliases, optional=[name for name, _ in net.named_buffers()])


#: ``from_pretrained`` keywords the meta-device build takes, or that an Auto class passes on whatever the
#: call (others: one line pointing at the alternative)
_META_KWARGS = ("config", "dtype", "torch_dtype", "attn_implementation", "local_files_only", "trust_remote_code",
                "_from_auto", "_from_pipeline", "adapter_kwargs", "revision", "_commit_hash")
_IN_STRATEGY_INIT = contextvars.ContextVar("lightning_par_strategy_init", default=False)


def in_strategy_init() -> bool:
    """Whether a lightning_par strategy's meta-device init context is active (it fills pretrained weights)."""
    return _IN_STRATEGY_INIT.get()


@contextmanager
def transformers_from_pretrained_on_meta() -> Iterator[None]:
    """Inside (a strategy's meta-device init context), transformers' own ``from_pretrained(DIR)`` on a
    local directory -- a model class's, or an Auto class's, which resolves the class and calls it --
    builds the model on the meta device and marks it ``Pretrained(DIR)``, so the strategy fills each
    rank's shards: what it would otherwise refuse under a meta device ("an anti-pattern"). Keywords
    beyond the build's (``_META_KWARGS``) are accepted only at their no-op values (None, False: what
    an Auto class passes on). Only when transformers is already imported (the user's code imports
    it); restored on exit."""
    import sys

    if "transformers" not in sys.modules:
        token = _IN_STRATEGY_INIT.set(True)
        try:
            yield
        finally:
            _IN_STRATEGY_INIT.reset(token)
        return
    from transformers import AutoConfig, PreTrainedModel

    def build(cls: type, directory: Any, kwargs: dict) -> torch.nn.Module:
        unknown = sorted(k for k, v in kwargs.items() if k not in _META_KWARGS and v not in (None, False))
        path = Path(str(directory))
        if unknown or not (path / "config.json").is_file():
            why = f"the keywords {', '.join(unknown)}" if unknown else f"{directory} (not a local save_pretrained directory)"
            raise WeightsError(f"{cls.__name__}.from_pretrained under a lightning_par strategy cannot take {why}; "
                               "use lightning_par.models.from_pretrained(DIR) in configure_model")
        config = kwargs.get("config") or AutoConfig.from_pretrained(str(path), local_files_only=True)
        options = {k: kwargs[k] for k in ("attn_implementation",) if k in kwargs}
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        # a dtype asked for, else the run's (Lightning's precision sets the default), not config.json's
        options["dtype"] = dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()
        net = cls._from_config(config, **options)
        check_pretrained(net, SafetensorsWeights(path))
        return mark_pretrained(net, str(path))

    saved = PreTrainedModel.__dict__["from_pretrained"]
    PreTrainedModel.from_pretrained = classmethod(lambda cls, d, *a, **kw: build(cls, d, _args(a, kw)))
    token = _IN_STRATEGY_INIT.set(True)
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = saved
        _IN_STRATEGY_INIT.reset(token)


def _args(args: tuple, kwargs: dict) -> dict:
    if args:  # model_args for the model's __init__: not a layout the meta build can honour
        raise WeightsError("from_pretrained under a lightning_par strategy takes keywords only; use "
                           "lightning_par.models.from_pretrained(DIR) in configure_model")
    return kwargs


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
                  aliases: Mapping[str, str] | None = None, optional: Iterable[str] = ()) -> None:
    """One line if ``weights`` cannot fill a model whose parameters are ``expected`` (name -> shape): a
    parameter it lacks (a tied one may be saved under either name: ``aliases`` maps one to the
    other), one of another shape, or a tensor the model has no place for (another architecture's
    checkpoint). ``optional`` names tensors it may hold or not (buffers: their init makes them)."""
    partner = dict(aliases or {})
    partner.update({v: k for k, v in partner.items()})
    for key, shape in expected.items():
        name = key if key in weights else partner.get(key, key)
        if name not in weights:
            raise WeightsError(f"pretrained weights: {weights.directory} has no tensor {key} "
                               "(a checkpoint of another architecture or size?)")
        if tuple(weights.shape(name)) != tuple(shape):
            raise WeightsError(f"pretrained weights: {weights.directory}: {name} has shape "
                               f"{tuple(weights.shape(name))}, the model's config gives {tuple(shape)}")
    known = {*expected, *partner, *optional}
    unused = [k for k in weights.keys() if k not in known]
    if unused:
        raise WeightsError(f"pretrained weights: {weights.directory} holds {unused[0]} (and {len(unused) - 1} more), "
                           "which the model built from its config.json does not have")


__all__ = ["INDEX_NAME", "WEIGHTS_NAME", "SafetensorsWeights", "WeightRef", "WeightSources", "WeightsError", "check_pretrained", "check_weights",
           "transformers_from_pretrained_on_meta", "weight_sources"]
