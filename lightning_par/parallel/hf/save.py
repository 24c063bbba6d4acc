"""transformers' own ``model.save_pretrained(DIR)`` for a Hugging Face model whose parameters are sharded.

transformers 5 writes ``model.state_dict()`` from global rank 0 with safetensors, which cannot read a
``DTensor``'s storage. On a Llama sharded with FSDP2 (lp_fsdp, lp_zero3: every parameter a DTensor), the
call on every rank raises "Attempted to access the data pointer on an invalid python storage" on
rank 0 after it has written ``config.json`` and ``generation_config.json``, while the other ranks
return as if done; called on rank 0 alone it raises the same. (transformers' own FSDP support covers
only a model it sharded itself, ``config.distributed_config``, and then gathers the whole state dict
onto rank 0's host.)

``install_sharded_save`` (the strategies call it once the model is sharded) gives each such Hugging Face
model an instance-level ``save_pretrained`` with transformers' signature that is a collective, the
pattern accelerate and torchtitan document for sharded models: **every rank calls it**. The tensors are
gathered whole one at a time (``DTensor.full_tensor``); global rank 0 appends each to the safetensors
file it is writing and drops it, so no process holds more than one full tensor beside its shards. What
comes out is what transformers writes for the same model unsharded: its file sharding and index
(``split_torch_state_dict_into_shards``, ``max_shard_size``, ``variant``), a tied weight once under the
name transformers keeps, ``_keys_to_ignore_on_save`` left out, names reverted to the checkpoint's
original layout where transformers' conversion is a renaming, its config and generation config. Files
of the directory it does not write (a tokenizer saved there) are left alone, as transformers leaves them.

A model that is whole on every rank (single, ddp, zero1, zero2) keeps transformers' method untouched, but
for a LoRA-adapted one. A LoRA model (``model.lora.rank=R``: its target linears hold ``lora_A``/``lora_B``
beside their frozen weight) is written merged, sharded or not: each adapted weight as ``W + (alpha / r) B A``
(``strategies/checkpoint/lora_export.py``), the adapter keys left out, so the directory is the plain model
``from_pretrained`` loads; transformers' own method would write the unmerged base and the adapters under
keys the architecture does not have. Whole on this process, it gets ``save_merged_pretrained``, not a
collective (called where transformers' method would be); sharded, the collective merges each layer as its
three tensors are gathered.

A model cut into pipeline stages (no rank holds all its layers; transformers' method would silently
write rank 0's stages only) gets a ``save_pretrained`` that refuses in one line and names the export.

Called by some ranks only (rank 0 under ``if trainer.is_global_zero:``), the collective would wait in
its first gather until the training group's timeout (30 minutes by default); instead every rank that
called it raises ``SaveError`` (one line) after ``ARRIVAL_TIMEOUT_S`` (``_wait_for_every_rank``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
import types
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par.parallel.adapters.lora import lora_layers
from lightning_par.parallel.hf.plan import is_hf_model
from lightning_par.parallel.init.materialize import canonical_name
from lightning_par.parallel.init.weights import INDEX_NAME, WEIGHTS_NAME
from lightning_par.parallel.pipeline.stages import RemoteLayer

log = logging.getLogger(__name__)

#: how long the collective ``save_pretrained`` waits for every rank to call it before it raises (a rank
#: calling it alone, e.g. under ``if trainer.is_global_zero:``); read when the strategy sets the model up
ARRIVAL_TIMEOUT_S = 120.0

#: the arrival check of each model given the collective method: its gloo group and timeout (weakly held:
#: for the model's lifetime, not the process')
_CHECKS: weakref.WeakKeyDictionary[nn.Module, tuple[Any, float]] = weakref.WeakKeyDictionary()
#: safetensors' dtype names
#: safetensors' dtype names
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
           torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64"}
_SHARD_FILE = re.compile(r"(.*?)-\d{5}-of-\d{5}")  # transformers' name of one file of a sharded save


class SaveError(RuntimeError):
    """The collective ``save_pretrained`` could not run or write; the same one line on every rank that
    called it."""


# ---------------------------------------------------------------------------------- installing
def install_sharded_save(module: nn.Module) -> int:
    """Give each outermost Hugging Face model in ``module`` whose transformers ``save_pretrained`` would
    fail (DTensor parameters) or write a partial model (pipeline stages) a method that does not.
    Collective when it installs the sharded one (it creates the check group): every rank calls it at
    the same point, after sharding. Returns how many models got one."""
    count = 0
    for model in _outermost_hf_models(module):
        if any(isinstance(m, RemoteLayer) for m in model.modules()):
            model.save_pretrained = types.MethodType(_refuse_pipeline, model)
        elif any(isinstance(p, DTensor) for p in model.parameters()):
            _CHECKS[model] = (_check_group(ARRIVAL_TIMEOUT_S), ARRIVAL_TIMEOUT_S)
            model.save_pretrained = types.MethodType(save_sharded_pretrained, model)
        elif lora_layers(model):
            model.save_pretrained = types.MethodType(save_merged_pretrained, model)
        else:
            continue
        count += 1
    return count


def _outermost_hf_models(module: nn.Module) -> list[nn.Module]:
    """Every Hugging Face model in ``module`` that no other one holds (a student and its teacher, say)."""
    found: list[tuple[str, nn.Module]] = []
    for path, sub in module.named_modules():
        if is_hf_model(sub) and not any(path.startswith(p + ".") or not p for p, _ in found):
            found.append((path, sub))
    return [m for _, m in found]


def _check_group(timeout_s: float) -> Any:
    """A gloo group over every rank for the arrival check only (None with one rank). Created here, while
    every rank is present: creating a group is itself collective, so it could not be created inside a
    call that only some ranks make. Its timeout is the arrival timeout: gloo bounds a rank other than 0
    in ``monitored_barrier`` by the group's timeout, not by the barrier's argument. Its own group, not
    the training one, also because a barrier abandoned after a timeout stays pending on its group, where
    a later collective of training could be matched with it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _refuse_pipeline(model: nn.Module, *args: Any, **kwargs: Any) -> None:
    """transformers' method would write rank 0's stages as if they were the model: refused instead."""
    raise SaveError(f"{type(model).__name__.removeprefix('FSDP')}.save_pretrained: this model is cut into pipeline "
                    "stages and no rank holds all its layers; call lightning_par.strategies.checkpoint.export.save_pretrained(trainer, DIR) "
                    "on every rank instead (it writes the same transformers directory)")


# ---------------------------------------------------------------------------------- the method
def save_sharded_pretrained(model: nn.Module, save_directory: str | os.PathLike, is_main_process: bool = True,
                            state_dict: dict | None = None, push_to_hub: bool = False,
                            max_shard_size: int | str = "50GB", variant: str | None = None,
                            token: str | bool | None = None, save_peft_format: bool = True,
                            save_original_format: bool = True, distributed_checkpoint: bool = False,
                            **kwargs: Any) -> None:
    """transformers' ``save_pretrained`` for this sharded model, as a collective: call it on every rank
    with the same arguments. Global rank 0 writes (when its ``is_main_process`` is true), into rank 0's
    ``save_directory``; the other ranks take part in gathering each tensor. A rank that calls it while
    another does not raises ``SaveError`` after ``ARRIVAL_TIMEOUT_S`` instead of waiting for ever. With
    ``state_dict=`` (full tensors the caller gathered) transformers' own method writes it."""
    if state_dict is not None:  # full tensors the caller gathered: transformers' own method writes them
        return type(model).save_pretrained(model, save_directory, **_given(locals(), kwargs))
    name = f"{type(model).__name__.removeprefix('FSDP')}.save_pretrained"
    _refuse_unsupported(model, name, push_to_hub=push_to_hub, distributed_checkpoint=distributed_checkpoint)
    if model not in _CHECKS:
        raise SaveError(f"{name}: this model was not set up by a lightning_par strategy (a copy of it?); call "
                        "save_pretrained on the model the strategy sharded")
    _wait_for_every_rank(*_CHECKS[model], name)
    tensors = _state_tensors(model)
    plan: Plan | str = ""
    if dist.get_rank() == 0:  # rank 0's plan, or its error, for every rank: no rank waits on one that raised
        try:
            plan = _plan(model, tensors, save_original_format, max_shard_size, variant)
        except Exception as e:  # noqa: BLE001 - a bad max_shard_size, a model transformers cannot revert
            plan = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    directory, write, plan = _broadcast((os.fspath(save_directory), bool(is_main_process), plan))
    if isinstance(plan, str):
        raise SaveError(f"{name} to {directory} failed: {plan}")
    _check_same_model(plan, tensors, name)
    _record_in_config(model)
    merges = _lora_merges(model)
    error = ""
    if write and dist.get_rank() == 0:
        error = _write(model, directory, plan, tensors, merges)
    else:
        for _ in _gathered(plan, tensors, merges):
            pass
    _finish(error, directory, name)


def _given(args: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A ``save_pretrained`` replacement's own arguments, as transformers' method takes them."""
    return {**{k: v for k, v in args.items() if k not in ("model", "save_directory", "kwargs")}, **kwargs}


def save_merged_pretrained(model: nn.Module, save_directory: str | os.PathLike, is_main_process: bool = True,
                           state_dict: dict | None = None, push_to_hub: bool = False,
                           max_shard_size: int | str = "50GB", variant: str | None = None,
                           token: str | bool | None = None, save_peft_format: bool = True,
                           save_original_format: bool = True, distributed_checkpoint: bool = False,
                           **kwargs: Any) -> None:
    """transformers' ``save_pretrained`` for a LoRA-adapted model whole in this process: the merged plain
    model, in the files transformers writes, one layer's tensors at a time. Not a collective: call it where
    transformers' own method would be called (one process writes when ``is_main_process``). With
    ``state_dict=`` transformers' own method writes that state dict."""
    if state_dict is not None:  # full tensors the caller gathered: transformers' own method writes them
        return type(model).save_pretrained(model, save_directory, **_given(locals(), kwargs))
    name = f"{type(model).__name__}.save_pretrained"
    _refuse_unsupported(model, name, push_to_hub=push_to_hub, distributed_checkpoint=distributed_checkpoint)
    tensors = _state_tensors(model)
    try:
        plan = _plan(model, tensors, save_original_format, max_shard_size, variant)
    except Exception as e:  # noqa: BLE001 - a bad max_shard_size, a model transformers cannot revert
        raise SaveError(f"{name} to {os.fspath(save_directory)} failed: {type(e).__name__}: "
                        f"{' '.join(str(e).split())[:300]}") from None
    _record_in_config(model)
    if is_main_process:
        error = _write(model, os.fspath(save_directory), plan, tensors, _lora_merges(model))
        if error:
            raise SaveError(f"{name} to {os.fspath(save_directory)} failed: {error}")


def _refuse_unsupported(model: nn.Module, name: str, *, push_to_hub: bool, distributed_checkpoint: bool) -> None:
    """What the collective method does not do: one line on every rank, before any collective."""
    if push_to_hub:
        raise SaveError(f"{name}: push_to_hub is not supported for a sharded model; save to a directory (every rank), "
                        "then upload it from one process")
    if distributed_checkpoint:
        raise SaveError(f"{name}: distributed_checkpoint=True is transformers' own sharded format for models it "
                        "sharded itself; lightning_par's sharded checkpoints are trainer.save_checkpoint(DIR)")
    if getattr(model, "_hf_peft_config_loaded", False) or getattr(model, "hf_quantizer", None) is not None:
        raise SaveError(f"{name}: PEFT adapters and quantized models are not supported when sharded")


def _wait_for_every_rank(group: Any, timeout_s: float, name: str) -> None:
    """Raise ``SaveError`` unless every rank enters this call within ``timeout_s``.

    Everything after this is collective on the training groups (whose timeout is the strategy's, 30
    minutes by default), so a rank calling alone would wait there. gloo's ``monitored_barrier`` on the
    check group has a timeout of its own, comes before any of them, and fails on every rank that
    entered it: rank 0 waits for each other rank (and names the ones missing), the others wait for rank
    0's reply. A peer that has already exited fails it at once (its connection closed).
    """
    if group is None:
        return
    started = time.monotonic()
    try:
        dist.monitored_barrier(group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        raise SaveError(f"{name}: not every rank called it ({_first_sentence(e)}; after "
                        f"{time.monotonic() - started:.0f} s); the model is sharded over {dist.get_world_size()} "
                        "ranks, so call save_pretrained on every rank (not under `if trainer.is_global_zero:`); "
                        "rank 0 writes") from None


def _first_sentence(e: BaseException) -> str:
    """gloo's message without its source location: "Ranks 1 failed to pass monitoredBarrier in 5000 ms",
    "Connection closed by peer ..."""
    text = re.sub(r"\[[^\]]*\.cc:\d+\]\s*", "", " ".join(str(e).split()))
    return text.split(". ")[0][:160]


def _broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (so all ranks gather in rank 0's order into rank 0's directory).
    On the training group: every rank is known to be here."""
    if dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _check_same_model(plan: Plan, tensors: dict[str, torch.Tensor], name: str) -> None:
    """Every rank holds each tensor of rank 0's plan with its shape, or all raise (before any gather: a
    rank missing one would leave the others waiting in its gather)."""
    problem = ""
    for item in (item for items in plan.files.values() for item in items):
        if item.source not in tensors or tuple(tensors[item.source].shape) != item.shape:
            what = "missing" if item.source not in tensors else f"of shape {tuple(tensors[item.source].shape)}"
            problem = f"{item.source} is {what} on rank {dist.get_rank()}"
            break
    problems = [""] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    if any(problems):
        raise SaveError(f"{name}: the ranks hold different models ({next(p for p in problems if p)})")


def _finish(error: str, directory: str, name: str) -> None:
    error = _broadcast(error)
    if error:
        raise SaveError(f"{name} to {directory} failed: {error}")


# ---------------------------------------------------------------------------------- what is written
@dataclass(frozen=True)
class Item:
    """One tensor of the files: its name there, the model tensor it is, its shape and dtype."""

    name: str
    source: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Plan:
    """The files to write (name -> items, in writing order) and the index (None: one file)."""

    files: dict[str, list[Item]]
    index: dict[str, Any] | None
    weights_name: str
    variant: str | None


def _state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state under its own names (wrapper parts removed), the ``Parameter`` objects
    themselves, so that a tie shows as one object under two names."""
    return {canonical_name(k): v for k, v in model.state_dict(keep_vars=True).items()}


def _plan(model: nn.Module, tensors: dict[str, torch.Tensor], original_format: bool, max_shard_size: int | str,
          variant: str | None) -> Plan:
    """transformers' steps on shapes only (meta placeholders): keys ignored on save, ties, the reverted
    conversion, the sharding into files."""
    from huggingface_hub import split_torch_state_dict_into_shards

    from lightning_par.parallel.adapters.lora import is_adapter_key

    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    # a LoRA model is written merged: its adapters are in the weights they adapt (``_lora_merges``)
    kept = _without_ties(model, [k for k in tensors if k not in ignored and not is_adapter_key(k)], tensors)
    placeholders = {k: torch.empty(tensors[k].shape, dtype=tensors[k].dtype, device="meta") for k in kept}
    names = _reverted_names(model, placeholders) if original_format else {k: k for k in placeholders}
    meta = {out: placeholders[src] for out, src in names.items()}
    weights_name = _add_variant(WEIGHTS_NAME, variant)
    pattern = weights_name.replace(".safetensors", "{suffix}.safetensors")
    split = split_torch_state_dict_into_shards(meta, filename_pattern=pattern, max_shard_size=max_shard_size)
    files = {file: [Item(out, names[out], tuple(meta[out].shape), meta[out].dtype) for out in outs]
             for file, outs in split.filename_to_tensors.items()}
    index = None
    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
    return Plan(files, index, weights_name, variant)


def _without_ties(model: nn.Module, names: list[str], tensors: dict[str, torch.Tensor]) -> list[str]:
    """``names`` with each tied copy left out, keeping the name transformers keeps: of the names sharing
    one tensor, those matching the model's declared tied keys (``_tied_weights_keys``, e.g. ``lm_head.weight``)
    are dropped, in sorted order, as long as one name remains; an undeclared tie keeps its first name."""
    patterns = _tied_weight_keys(model)
    by_object: dict[int, list[str]] = {}
    for k in names:
        by_object.setdefault(id(tensors[k]), []).append(k)
    dropped: set[str] = set()
    for group in (g for g in by_object.values() if len(g) > 1):
        declared = [k for k in sorted(group) if any(re.search(p, k) for p in patterns)][: len(group) - 1]
        rest = [k for k in group if k not in declared]
        dropped.update(declared + rest[1:])
    return [k for k in names if k not in dropped]


def _tied_weight_keys(model: nn.Module) -> list[str]:
    """The model's declared tied keys (transformers 5: a dict target -> source per module; 4: a list)."""
    keys = []
    for path, sub in model.named_modules():
        tied = getattr(sub, "_tied_weights_keys", None) or {}
        prefix = canonical_name(path)
        keys += [f"{prefix}.{k}" if prefix else k for k in (tied.keys() if isinstance(tied, dict) else tied)]
    return keys


def _reverted_names(model: nn.Module, placeholders: dict[str, torch.Tensor]) -> dict[str, str]:
    """Output name -> model name, as transformers reverts its load-time conversion (``save_original_format``)
    where that conversion is a renaming. A conversion that computes tensors (an MoE's stacked experts
    written back per expert) would need the tensors of a whole group at once: the model's own layout is
    written then, which ``from_pretrained`` loads as it is (transformers' ``save_original_format=False``)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without load-time conversions
        return {k: k for k in placeholders}
    source = {id(t): k for k, t in placeholders.items()}
    reverted = revert_weight_conversion(model, dict(placeholders))
    if all(id(t) in source for t in reverted.values()) and len(reverted) == len(placeholders):
        return {out: source[id(t)] for out, t in reverted.items()}
    log.warning("save_pretrained: %s's conversion of its checkpoint layout computes tensors; written in the model's "
                "own layout (transformers' save_original_format=False), which from_pretrained loads",
                type(model).__name__.removeprefix("FSDP"))
    return {k: k for k in placeholders}


def _add_variant(name: str, variant: str | None) -> str:
    """``model.safetensors`` -> ``model.<variant>.safetensors`` (transformers' rule)."""
    if variant is None:
        return name
    stem, ext = name.rsplit(".", 1)
    return f"{stem}.{variant}.{ext}"


# ---------------------------------------------------------------------------------- gathering, writing
#: a LoRA layer's weight key -> its adapters' keys and its scaling (``_lora_merges``)
Merges = dict[str, tuple[str, str, float]]


def _lora_merges(model: nn.Module) -> Merges:
    """Each LoRA layer's weight (canonical key) -> (its ``lora_A`` key, its ``lora_B`` key, its scaling)."""
    from lightning_par.parallel.adapters.lora import adapter_keys

    out = {}
    for path, layer in lora_layers(model):
        key = canonical_name(f"{path}.weight")
        a, b = adapter_keys(key)
        out[key] = (a, b, layer.scaling)
    return out


def _gathered(plan: Plan, tensors: dict[str, torch.Tensor],
              merges: Merges | None = None) -> Iterator[tuple[str, Item, torch.Tensor]]:
    """Each tensor of the plan whole, file by file, in the same order on every rank (each DTensor's
    gather is a collective over its mesh); a LoRA layer's weight merged with its adapters, gathered
    after it (``adapters.lora.merge``)."""
    from lightning_par.parallel.adapters.lora import merge

    merges = merges or {}
    for file, items in plan.files.items():
        for item in items:
            t = _full(tensors[item.source])
            if item.source in merges:
                a, b, scaling = merges[item.source]
                t = merge(t, _full(tensors[a]), _full(tensors[b]), scaling)
            yield file, item, t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t``. A shard kept on the host (CPU offload, or a model Lightning moved to the CPU
    after fit) is first moved to its mesh's device type, whose backend (NCCL) gathers only there."""
    t = t.detach()
    if not isinstance(t, DTensor):
        return t
    device_type = t.device_mesh.device_type
    if t.to_local().device.type != device_type:
        t = t.to(device_type)
    return t.full_tensor()


def _write(model: nn.Module, directory: str, plan: Plan, tensors: dict[str, torch.Tensor],
           merges: Merges | None = None) -> str:
    """Rank 0: the files, streamed; returns "" or the error (after taking part in every gather still
    due, so that no rank is left waiting in one)."""
    gathered = _gathered(plan, tensors, merges)
    written: list[str] = []
    try:
        os.makedirs(directory, exist_ok=True)
        _remove_stale_shards(directory, plan)
        for file, items in plan.files.items():
            path = os.path.join(directory, file)
            written.append(path)
            write_safetensors(path, items, (t for _, _, t in (next(gathered) for _ in items)))
        if plan.index is not None:
            with open(os.path.join(directory, _add_variant(INDEX_NAME, plan.variant)), "w", encoding="utf-8") as f:
                f.write(json.dumps(plan.index, indent=2, sort_keys=True) + "\n")
        _write_config(model, directory)
    except Exception as e:  # noqa: BLE001 - every rank raises it (``_finish``), none waits for ever
        for _ in gathered:
            pass
        for path in written:
            if os.path.isfile(path):
                os.remove(path)  # a cut-off weights file must not look like a saved model
        return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return ""


def _remove_stale_shards(directory: str, plan: Plan) -> None:
    """As transformers does: files of an earlier sharded save under this weights name that this save does
    not write (other files, a tokenizer's, are kept)."""
    stem = plan.weights_name.removesuffix(".safetensors")
    for name in os.listdir(directory):
        full = os.path.join(directory, name)
        if (name.startswith(stem) and os.path.isfile(full) and name not in plan.files
                and _SHARD_FILE.fullmatch(name.removesuffix(".safetensors")) is not None):
            os.remove(full)


def write_safetensors(path: str | os.PathLike, items: Sequence[Any], produce: Iterable[torch.Tensor]) -> None:
    """One safetensors file, tensor by tensor: ``items`` (each with ``name``, ``shape``, ``dtype``) and the
    tensors in their order. safetensors' ``save_file`` takes every tensor of the file at once; its format
    is a length-prefixed JSON header of offsets and then the raw bytes, and the offsets follow from the
    shapes, so the header goes first and each tensor is appended as it comes (gathered here, read from a
    checkpoint by ``export``; read back by safetensors in the tests)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in items:
        size = torch.Size(item.shape).numel() * torch.empty((), dtype=item.dtype).element_size()
        header[item.name] = {"dtype": _DTYPES[item.dtype], "shape": list(item.shape),
                             "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for item, t in zip(items, produce):
            if tuple(t.shape) != tuple(item.shape) or t.dtype != item.dtype:
                raise RuntimeError(f"{item.name} came out {tuple(t.shape)} {t.dtype}, "
                                   f"expected {item.shape} {item.dtype}")
            if t.numel():
                f.write(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _record_in_config(model: Any) -> None:
    """What transformers' ``save_pretrained`` sets in the config on every rank: the weights' dtype and the
    class (FSDP2's ``FSDP`` class prefix removed)."""
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]


def _write_config(model: Any, directory: str) -> None:
    """The config and generation config, and custom code if the model has any (transformers' files)."""
    if model.is_remote_code():
        from transformers.dynamic_module_utils import custom_object_save

        custom_object_save(model, directory, config=model.config)
    model.config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)
