"""Deferred initialisation: a model built on the meta device gets real weights only where it must.

Big models are built on ``torch.device("meta")`` (shapes only, no memory), cut, split and sharded
there, and only then materialised: ``to_empty`` allocates this rank's *local* tensors (its FSDP
shards, its TP slices, its pipeline stages' layers), and the values come from the model's own
initialisation.

Why not simply call ``reset_parameters()`` on the sharded module (what Lightning's and torch's
materialisation helpers do)? Because the weights would then depend on the layout: a random init
of a 1/N shard is not the 1/N slice of the single-device init, so loss parity with the one-device
run would be lost from step 0. Here the weights are a function of the model and the seed only:

- the model is split into *init groups* (``discovery.init_groups``: its blocks, then every other
  module owning tensors), which depend only on the model;
- each group is built on the host from a meta copy taken before any technique touched the model,
  seeded with ``hash(seed, group path)``, and initialised by the model's own rule
  (``init_weights(submodule)`` of the contract, a Hugging Face model's ``_init_weights``, else each
  submodule's ``reset_parameters()``);
- every rank then keeps only its slice of each tensor (``distribute_tensor`` with
  ``src_data_rank=None``: no communication, each rank slices its identical copy).

So host memory holds at most one group's full tensors at a time, beside the local shards. DTensor's
own RNG tracker would avoid even that, but its values depend on the sharding.
"""

from __future__ import annotations

import copy
import ctypes
import zlib
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_par.parallel.adapters.lora import fill_nf4, is_nf4
from lightning_par.parallel.init.init_trace import InitTrace, TensorRef
from lightning_par.parallel.init.weights import WeightRef, WeightsError, WeightSources
from lightning_par.parallel.init.ties import retie, tied_parameters
from lightning_par.parallel.memory.tiling import tile_sources

InitFn = Callable[[nn.Module], None]
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def canonical_name(name: str) -> str:
    """A parameter's name in the unwrapped model (wrapper path components removed)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def group_seed(seed: int, path: str) -> int:
    return zlib.crc32(f"{seed}:{path}".encode()) & 0x7FFF_FFFF


def capture_templates(module: nn.Module, groups: Iterable[str]) -> dict[str, nn.Module]:
    """Meta copies of the init groups, taken before techniques replace or wrap their tensors."""
    out = {}
    for path in groups:
        sub = module.get_submodule(path) if path else module
        if path == "":  # the root's own tensors only: a shallow module holding just those
            shell = nn.Module()
            for name, p in sub.named_parameters(recurse=False):
                shell.register_parameter(name, nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad))
            for name, b in sub.named_buffers(recurse=False):
                shell.register_buffer(name, torch.empty_like(b, device="meta"))
            out[path] = shell
        else:
            out[path] = copy.deepcopy(sub)
    return out


def default_init(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


@torch.no_grad()
def materialize(module: nn.Module, *, device: torch.device, templates: dict[str, nn.Module], seed: int,
                init_fn: InitFn | None = None, param_device: torch.device | None = None,
                trace: InitTrace | None = None, refs: dict[str, TensorRef] | None = None,
                weights: WeightSources | None = None, home: Callable[[nn.Module], None] | None = None,
                after_group: Callable[[str], None] | None = None) -> int:
    """Allocate ``module``'s local tensors on ``device`` and fill them from the seeded group inits.

    ``module`` may be sharded (FSDP2, DTensor TP) or hold only some groups (a pipeline rank);
    groups with no tensor on this rank are skipped without being built. Returns the number of
    tensors filled; raises if a local tensor got no value. ``param_device`` (default ``device``)
    places the parameters apart from the buffers: FSDP2's CPU offload wants its parameter shards in
    host memory, while buffers (masks, rotary tables) stay on the compute device (as torchtitan does).

    Which value a tensor gets: the model's declared init (``init_fn``) where it sets the tensor; the
    constructor's own value (``trace``, recorded while the model was built, ``init_trace.py``) for a
    model without a declared init, or for what the declared init leaves unset; else the submodules'
    ``reset_parameters()``. A host tensor starts filled with a sentinel (NaN), so a tensor that no
    init sets and no recorded constructor call made is an error naming it, never garbage.

    ``weights`` (pretrained checkpoints, ``WeightSources``) overrides all of these for the tensors it
    holds: each local tensor is read as its slice of the checkpoint's tensor, and a group whose
    tensors all come from it is never built on the host.
    """
    declared = init_fn is not None
    init = init_fn or default_init
    ties = tied_parameters(module)
    module.to_empty(device=param_device or device)
    if param_device is not None and torch.device(param_device) != torch.device(device):
        for sub in module.modules():
            for name, buf in sub._buffers.items():
                if buf is not None:
                    sub._buffers[name] = torch.empty_like(buf, device=device)
    retie(module, ties)  # to_empty gives each use of a shared parameter its own tensor
    if home is not None:  # before any value is written: the anonymous pages to_empty reserved are never touched
        home(module)
    targets: dict[str, torch.Tensor] = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        targets[canonical_name(name)] = t
    filled: set[str] = set()
    pieces = tile_sources(module, canonical_name)  # a tiled layer's tiles take row blocks of its init
    for path, template in templates.items():
        prefix = f"{path}." if path else ""
        names = [prefix + n for n, _ in [*template.named_parameters(), *template.named_buffers()]]
        if not any(n in targets or any(piece in targets for piece, _ in pieces.get(n, ())) for n in names):
            continue  # lives on another pipeline rank (or is a tied head whose tiles the embedding fills)
        loaded = {n: src for n in names if weights is not None and (src := weights.find(n)) is not None}
        shapes = {prefix + n: t.shape for n, t in [*template.named_parameters(), *template.named_buffers()]}
        for key, ref in loaded.items():
            if ref.shape != shapes[key]:
                raise WeightsError(f"pretrained weights: {ref.weights.directory}: {ref.key} has shape "
                                   f"{tuple(ref.shape)}, the model's {key} has {tuple(shapes[key])}")
        for key in loaded:
            if key in targets:
                _copy_local(targets[key], loaded[key])
                filled.add(key)
            for piece, block in pieces.get(key, ()):
                if piece in targets:
                    _copy_local(targets[piece], loaded[key], block)
                    filled.add(piece)
        if len(loaded) == len(names):  # every tensor of the group came from the checkpoint: nothing to initialise
            _release_free_memory()  # the slices read were temporaries: hand their pages back (see below)
            if after_group is not None:
                after_group(path)
            continue
        host = template.to_empty(device="cpu")
        for t in [*host.parameters(), *host.buffers()]:
            _fill_sentinel(t)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(group_seed(seed, path))
            for sub in host.modules():
                init(sub)
            wanted = {prefix + n: t for n, t in [*host.named_parameters(), *host.named_buffers()]
                      if prefix + n not in loaded and (not declared or _unset(t))}
            recorded = trace.replay({k: refs[k] for k in wanted if k in refs}) if trace and refs else {}
        for name, full in [*host.named_parameters(), *host.named_buffers()]:
            key = prefix + name
            if key in loaded:
                continue
            if key in recorded:
                full = recorded[key]
            elif _unset(full):
                raise RuntimeError(
                    f"materialize: {key} of shape {tuple(full.shape)} is set by no init function and its "
                    "constructor's value was not recorded (build the model in configure_model or "
                    "trainer.init_module(), or initialise it in reset_parameters())")
            if key in targets:
                _copy_local(targets[key], full)
                filled.add(key)
            for piece, block in pieces.get(key, ()):
                if piece in targets:
                    _copy_local(targets[piece], full, block)
                    filled.add(piece)
        host = full = None  # drop the last references before trimming
        templates[path] = template.to("meta")  # release the host copy
        _release_free_memory()
        if after_group is not None:
            after_group(path)
    missing = sorted(set(targets) - filled)
    if missing:
        raise RuntimeError(f"materialize: no init group covers {missing[:3]}; its tensors would stay uninitialised")
    return len(filled)


def _fill_sentinel(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _unset(t: torch.Tensor) -> bool:
    """Still (partly) the sentinel: no init function set it (an integer tensor only when wholly so)."""
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(t.isnan().any())
    return bool((t == torch.iinfo(t.dtype).min).all())


def _copy_local(target: torch.Tensor, full: torch.Tensor | WeightRef, block: tuple[slice, ...] | None = None) -> None:
    """Copy ``target``'s local piece of ``full`` (of ``block`` of it: a tile's, one slice per leading
    dimension), where ``full`` is a host tensor or a checkpoint tensor read lazily (only the piece is read)."""
    lead = tuple(block) if block is not None else ()
    if is_nf4(target):  # QLoRA's base: the whole weight quantized, then this rank's rows (adapters/lora.py)
        fill_nf4(target, full[()] if isinstance(full, WeightRef) else full)
        return
    if not isinstance(target, DTensor):
        if isinstance(full, WeightRef):  # the whole tensor (or a tile's block of it), read block by block
            _copy_in_chunks(target, full, [*lead, *(slice(0, n) for n in full.shape[len(lead):])])
        else:
            target.copy_(full[lead] if lead else full)
    elif all(isinstance(p, (Shard, Replicate)) for p in target.placements):
        # the local piece is one block of the full tensor: copy it from a view, no intermediate copy
        shape = (*(s.stop - s.start for s in lead), *full.shape[len(lead):])
        local, offset = compute_local_shape_and_global_offset(torch.Size(shape), target.device_mesh,
                                                              target.placements)
        if 0 in tuple(local):
            return  # an empty shard (fewer rows than ranks): nothing to read, and its offset is past the end
        index = [slice(o, o + n) for o, n in zip(offset, local)]
        for d, s in enumerate(lead):  # the tile's block starts there in the untiled tensor
            index[d] = slice(s.start + index[d].start, s.start + index[d].stop)
        _copy_in_chunks(target.to_local(), full, index)
    else:  # strided shards (FSDP over a TP-sharded dim): DTensor knows the layout
        whole = full[lead] if lead else full[()] if isinstance(full, WeightRef) else full
        piece = distribute_tensor(whole.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(piece.to_local())


_CHUNK_BYTES = 16 << 20


def _copy_in_chunks(dst: torch.Tensor, full: torch.Tensor | WeightRef, index: list[slice]) -> None:
    """``dst.copy_(full[index])``; a checkpoint tensor is read in blocks of leading rows of at most
    ``_CHUNK_BYTES``. Each read maps the file only while it runs (``SafetensorsWeights.read``), so what a
    read holds beside ``dst`` -- the file pages it touched and the block it returns -- stays one block,
    not the whole slice: loading a large embedding's shard otherwise adds two copies of it to the
    rank's peak."""
    if not isinstance(full, WeightRef) or dst.dim() == 0 or dst.numel() * dst.element_size() <= _CHUNK_BYTES:
        dst.copy_(full[tuple(index)])
        return
    rows = max(1, _CHUNK_BYTES // max(1, dst[0].numel() * dst.element_size()))
    first = index[0]
    for start in range(0, dst.shape[0], rows):
        stop = min(start + rows, dst.shape[0])
        block = [slice(first.start + start, first.start + stop), *index[1:]]
        dst[start:stop].copy_(full[tuple(block)])


def _release_free_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's ``malloc_trim``). Each init group's host tensors
    are freed before the next group's are allocated, but glibc raises its mmap threshold after the
    first large free, so later tensors of up to 32 MB come from the heap, whose freed pages it keeps:
    without this, a rank's resident memory grows by a part of every group and deferred
    initialisation loses much of its point. A no-op where glibc is absent."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()
