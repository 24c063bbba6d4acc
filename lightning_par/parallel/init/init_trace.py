"""What a model's constructor did to its tensors, recorded on the meta device and replayable for real.

A model built on the meta device (``torch.device("meta")``, how every strategy here builds it in
``configure_model``) has shapes but no values. ``materialize.py`` refills them with the model's own
init functions (``reset_parameters``, ``_init_weights``, the contract's ``init_weights``), but a
tensor that no such function touches -- ``nn.Parameter(torch.randn(1, 1, d) * 0.02)`` (a ViT's
``cls_token``), ``register_buffer("scale", torch.full((d,), 0.5))``, a ``trunc_normal_`` applied in
``__init__`` -- would keep whatever memory it was given. So while the model is built,
``InitTrace.recording()`` records every torch call that produces or changes a meta tensor (a
``TorchFunctionMode``, plus the ``torch.nn.init`` functions, which return early on meta tensors
before torch sees any op), and ``replay`` re-runs, on real host tensors, just the calls that a given
set of tensors depends on, in their original order. Aliasing (views, ``nn.Parameter`` wrapping,
in-place init) is followed through storages: every meta tensor is resolved as a strided view of the
real tensor that first allocated its storage.

Why our own: torchdistx's ``deferred_init`` did this in C++ and is no longer maintained for current
torch; torch itself offers meta-device construction but no record of the values.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")
_active: list[InitTrace] = []


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _meta_tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor) and x.is_meta]


@dataclass
class _Event:
    func: Any
    args: tuple
    kwargs: dict
    reads: frozenset[int]
    writes: frozenset[int]
    outputs: tuple[torch.Tensor, ...]  #: the meta outputs, kept alive so storage keys are never reused
    default_dtype: torch.dtype


class _Recorder(TorchFunctionMode):
    def __init__(self, trace: InitTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.trace._record(func, args, kwargs, out)
        return out


class InitTrace:
    """The record of one model construction (or several, appended)."""

    def __init__(self) -> None:
        self.events: list[_Event] = []

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        outs = _meta_tensors(out)
        name = getattr(func, "__name__", "")
        mutated = (name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))) and args \
            and isinstance(args[0], torch.Tensor) and args[0].is_meta
        if not outs and not mutated:
            return
        writes = {storage_key(t) for t in outs}
        if mutated:
            writes.add(storage_key(args[0]))
        reads = frozenset(storage_key(t) for t in _meta_tensors((args, kwargs)))
        self.events.append(_Event(func, args, kwargs, reads, frozenset(writes), tuple(outs),
                                  torch.get_default_dtype()))

    @contextlib.contextmanager
    def recording(self) -> Iterator[InitTrace]:
        """Record while the block builds a model (on the meta device, entered by the caller)."""
        _active.append(self)
        try:
            with _Recorder(self), _patched_init_functions():
                yield self
        finally:
            _active.remove(self)

    @torch.no_grad()
    def replay(self, targets: dict[str, TensorRef], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Real values of ``targets`` (name -> ``TensorRef`` of its meta tensor): the recorded calls
        they depend on, re-run in order on ``device`` under the caller's RNG state. Names whose storage
        no recorded call allocated are left out."""
        needed = {ref.key for ref in targets.values()}
        chosen: list[_Event] = []
        for event in reversed(self.events):
            if event.writes & needed:
                chosen.append(event)
                needed |= event.reads
        real: dict[int, torch.Tensor] = {}  # storage key -> the real tensor that allocated it

        def resolve(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_meta:
                base = real.get(storage_key(x))
                if base is None:
                    raise _Unreplayable
                return base.as_strided(x.shape, x.stride(), x.storage_offset())
            if (isinstance(x, torch.device) and x.type == "meta") or (isinstance(x, str) and x == "meta"):
                return torch.device(device)
            return x

        broken: set[int] = set()
        with torch.device(device):
            for event in reversed(chosen):
                try:
                    args, kwargs = tree_map(resolve, (event.args, event.kwargs))
                except _Unreplayable:
                    broken |= event.writes
                    continue
                previous = torch.get_default_dtype()
                torch.set_default_dtype(event.default_dtype)
                try:
                    out = event.func(*args, **kwargs)
                finally:
                    torch.set_default_dtype(previous)
                real_outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
                for meta, got in zip(event.outputs, real_outs):
                    real.setdefault(storage_key(meta), got)
        return {name: real[ref.key].as_strided(ref.shape, ref.stride, ref.offset) for name, ref in targets.items()
                if ref.key in real and ref.key not in broken}


class _Unreplayable(Exception):
    """A recorded call reads a meta tensor that no recorded call allocated."""


@contextlib.contextmanager
def _patched_init_functions() -> Iterator[None]:
    """``torch.nn.init``'s functions return early on meta tensors (before any torch op that the mode
    would see), so while recording they record themselves instead."""
    originals = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS if hasattr(nn.init, name)}

    def wrap(original: Any) -> Any:
        @functools.wraps(original)
        def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not (_active and isinstance(tensor, torch.Tensor) and tensor.is_meta):
                return original(tensor, *args, **kwargs)
            _active[-1]._record(original, (tensor, *args), kwargs, tensor)
            return tensor
        return recorded

    for name, original in originals.items():
        setattr(nn.init, name, wrap(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)


@dataclass(frozen=True)
class TensorRef:
    """Where a meta tensor lives: its storage and its layout in it."""

    key: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorRef:
        return cls(storage_key(t), tuple(t.shape), tuple(t.stride()), t.storage_offset())


def tensor_refs(module: nn.Module, canonical: Any = lambda n: n) -> dict[str, TensorRef]:
    """Name -> ``TensorRef`` of every meta parameter and buffer of ``module`` (taken before any
    technique replaces them)."""
    return {canonical(n): TensorRef.of(t) for n, t in [*module.named_parameters(remove_duplicate=False),
                                                       *module.named_buffers(remove_duplicate=False)] if t.is_meta}
