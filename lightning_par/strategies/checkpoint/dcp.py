"""Sharded, strategy-neutral checkpoints through ``torch.distributed.checkpoint`` (DCP), and a
training dataloader that resumes mid-epoch.

One format for every strategy. A checkpoint is a directory in the layout of Lightning's sharded
checkpoints (its ``FSDPStrategy``'s): DCP shard files plus ``.metadata``, holding ``model`` (model
state) and ``optimizer_0``, ``optimizer_1``, ... (optimizer states), and ``meta.pt`` (everything
else Lightning saves: loops, callbacks, LR schedulers, hyperparameters), written by global rank 0.
Everything saved is plain Python (dict, list, tuple, str, numbers, None) or tensors -- OmegaConf
containers from Hydra-instantiated arguments are converted at save time (``plain``) -- so
``torch.load(weights_only=True)`` reads ``meta.pt``, and Lightning's own
``python -m lightning.pytorch.utilities.consolidate_checkpoint <dir>`` turns a checkpoint into one
``torch.load``-able file (``state_dict``, ``optimizer_states`` and the rest, as a Lightning
checkpoint). Checkpoints written with the older model key ``state_dict`` still load. Model and
optimizer states use the canonical layout of ``torch.distributed.checkpoint.state_dict``: keyed by
parameter FQN (``net.blocks.0.attn.wq.weight``; wrapper prefixes such as activation
checkpointing's are removed), optimizer state ``{"state": {fqn: {"step", "exp_avg", ...}},
"param_groups": [{..., "params": [fqn, ...]}]}``. Each rank writes what it holds:

- ``single`` / ``ddp``: full tensors; DCP writes each replicated tensor once.
- ``zero3`` / ``fsdp``: ``DTensor`` shards; DCP records every shard's offset in the global tensor.
- ``zero1``: full model; each rank writes the optimizer state of the parameters it owns.
- ``zero2``: full model; optimizer state converted from the flat shard to the canonical layout
  (``Zero2Optimizer.full_state_dict``) -- the full state exists transiently on every rank.

Loading asks DCP for the tensors this rank needs in the layout it needs (a DTensor shard, a full
tensor, the owned parameters only), and DCP reads the matching pieces from whatever layout wrote
them. So a checkpoint saved by zero3 on 4 ranks resumes under ddp on 2, and so on.

Loop state: Lightning restores global step and epoch itself, and resumes a dataloader mid-epoch
only if the loader is *stateful*. ``ResumableLoader`` makes ours so: it records how many samples of
the epoch's (data-parallel-size independent) order were consumed -- counted over the global batch,
so the position survives a change of world size -- and skips them when the epoch resumes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.core.optimizer import LightningOptimizer
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_par.parallel.hf.plan import find_hf_model
from lightning_par.core.units import fmt_bytes
import lightning_par.strategies.checkpoint.checksums as checksums
from lightning_par.parallel.adapters.lora import dequantized_state, is_nf4
from lightning_par.strategies.checkpoint.lora_export import facts_of_module
from lightning_par.strategies.checkpoint.errors import CheckpointError, CheckpointSaveError, _cause
from lightning_par.strategies.checkpoint.lightning_file import check_lightning_file, load_lightning_file
from lightning_par.parallel.init.materialize import canonical_name
from lightning_par.parallel.tensor.tp_styles import gather_packed, has_packed, scatter_packed

#: the model's key in the DCP payload: Lightning's sharded layout (its consolidate tool renames it to state_dict)
MODEL_KEY = "model"
_LEGACY_MODEL_KEY = "state_dict"  # what lightning_par wrote before; still loaded
#: ``ckpt_path`` values Lightning resolves itself (not paths)
_LIGHTNING_CKPT_NAMES = ("last", "best", "hpc")


# a parameter's name without wrapper components (activation checkpointing, torch.compile, FSDP1):
# the same rule materialisation uses to find a parameter of the unwrapped model
canonical_fqn = canonical_name


def is_sharded_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


def plain(obj: Any) -> Any:
    """``obj`` with every container made plain Python, so ``torch.load(weights_only=True)`` reads it
    back: OmegaConf containers (what Hydra passes to constructors, hence what ``save_hyperparameters``
    records) become dicts/lists, other mappings dicts, paths strings, named tuples tuples. Tensors
    (DTensors included) and scalars are kept as they are."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (DictConfig, ListConfig)):
        return OmegaConf.to_container(obj, resolve=True)
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(plain(v) for v in obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return obj


def check_checkpoint(path: str | Path | None) -> None:
    """Raise ``CheckpointError`` (one line naming the file) unless ``path`` is a complete, readable
    lightning_par checkpoint directory. Cheap (reads ``.metadata`` and ``meta.pt``, stats the shard
    files), so it runs before any process starts; ``None`` and Lightning's names (``last``, ``best``,
    ``hpc``) pass. Damage it finds: a missing or empty directory, no ``.metadata`` (DCP writes it
    last, so a checkpoint cut off mid-save has none), a ``.metadata`` DCP cannot read, a shard file
    missing or shorter than ``.metadata`` says, no model state, a missing or unreadable ``meta.pt``,
    and a file whose contents differ from those saved (``checksums.json``, ``checkpoint/checksums.py``:
    this reads the checkpoint once, once per process)."""
    if path is None or str(path) in _LIGHTNING_CKPT_NAMES:
        return
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():  # a Lightning single-file checkpoint (its own strategies'): converted when loaded
        check_lightning_file(path)
        return
    metadata_file = path / ".metadata"
    if not metadata_file.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no .metadata (written last, after every shard)")
    for name in (".metadata", _METADATA_FILENAME):
        if (path / name).is_file() and (path / name).stat().st_size == 0:
            raise CheckpointError(f"checkpoint file {path / name} is empty")
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure to unpickle means the file is damaged
        raise CheckpointError(f"checkpoint file {metadata_file} is damaged: {_cause(e)}") from None
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"checkpoint file {shard} is missing (listed in {metadata_file})")
        if shard.stat().st_size < size:
            raise CheckpointError(f"checkpoint file {shard} is truncated: {shard.stat().st_size} bytes, "
                                  f".metadata needs {size}")
    saved = {k.split(".", 1)[0] for k in metadata.state_dict_metadata}
    if not saved & {MODEL_KEY, _LEGACY_MODEL_KEY}:
        raise CheckpointError(f"checkpoint {path} holds no model state (keys: {', '.join(sorted(saved)) or 'none'})")
    meta_file = path / _METADATA_FILENAME
    if not meta_file.is_file():
        raise CheckpointError(f"checkpoint file {meta_file} is missing")
    try:
        torch.load(meta_file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated zip, empty file, unsafe pickle: all unreadable
        raise CheckpointError(f"checkpoint file {meta_file} is damaged or not safely loadable: {_cause(e)}") from None
    checksums.verify(path, CheckpointError)


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def initialize_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping) -> None:
    """Create the optimizer's lazily-built state (one step with zero gradients and lr 0), so a
    checkpoint has tensors to load into. ``state``: where the optimizer really keeps its state
    (for ZeRO-1 the local optimizer's). Collective for sharded optimizers: every rank calls it.
    (torch's ``_init_optim_state`` does the same, but reads ``optimizer.state`` only.)"""
    if state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


class ResumableLoader:
    """A training dataloader Lightning can checkpoint (``state_dict``/``load_state_dict``).

    The position is the number of samples consumed in the current epoch over all data-parallel
    ranks; on resume the first ``position / (micro_batch * dp_size)`` micro-batches of the epoch are
    skipped (read and dropped: the order is regenerated from the sampler's seed and epoch, which
    Lightning sets before the first batch is drawn). Every other attribute is the loader's.
    """

    def __init__(self, loader: Any, dp_size: int) -> None:
        self.loader = loader
        self.dp_size = dp_size
        self._consumed = 0  # micro-batches of this epoch handed out (including skipped ones)
        self._skip = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        # a generator: nothing happens until the first batch is requested, after Lightning's set_epoch
        skip, self._skip = self._skip, 0
        self._consumed = 0
        it = iter(self.loader)
        for _ in range(skip):
            next(it)
            self._consumed += 1
        for batch in it:
            self._consumed += 1
            yield batch

    def _global_micro_batch(self) -> int:
        return int(self.loader.batch_size) * self.dp_size

    def state_dict(self) -> dict[str, int]:
        return {"samples_consumed": self._consumed * self._global_micro_batch()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        samples = int(state.get("samples_consumed", 0))
        step = self._global_micro_batch()
        if samples % step:
            raise ValueError(f"cannot resume mid-epoch: {samples} samples consumed is not a multiple of the global "
                             f"micro-batch {step}; resume with a global micro-batch that divides it")
        skip = samples // step
        self._skip = skip if skip < len(self.loader) else 0  # a finished epoch: the next one starts fresh


class DistributedCheckpointMixin:
    """Strategy mixin: save and load checkpoints as sharded DCP directories in the canonical layout.

    Model and optimizer states are loaded by ``load_checkpoint`` itself, after the strategy's setup
    (the model is sharded and the optimizers exist), so Lightning's own restore of them is off.
    Strategies whose optimizer keeps its state in another layout override the three
    ``*optimizer*`` hooks below (ZeRO-1 and ZeRO-2 do).
    """

    # ---------------------------------------------------------------- Lightning's interface
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return dequantized_state(get_model_state_dict(self.lightning_module))  # QLoRA's base: its values

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self.checkpoint_optimizer_state(_unwrap(optimizer))

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done in load_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        path = Path(self.broadcast(str(filepath)))
        checkpoint.update(export_facts(self.lightning_module))
        states = {MODEL_KEY: checkpoint.pop("state_dict")}
        for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
            states[f"optimizer_{i}"] = plain(opt_state)
        try:
            if self.is_global_zero:
                if path.exists():  # a stale file, or a checkpoint written by more ranks
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
                path.mkdir(parents=True)
                torch.save(plain(checkpoint), path / _METADATA_FILENAME)
            self.barrier()
            # DCP writes ``.metadata`` last, after every rank's shards: its presence marks a complete checkpoint
            dcp.save(gather_packed(states), checkpoint_id=path)  # packed TP weights replicated over tp
            self._write_checksums(path)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 -- DCP's own error is a BaseException
            # a full disk (or any failed write): no half-written checkpoint stays to fill the disk or to be
            # mistaken for one; the previous checkpoints are untouched
            if self.is_global_zero:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            raise CheckpointSaveError(save_failure(path, e)) from None
        self.barrier()

    def _write_checksums(self, path: Path) -> None:
        """Each rank hashes the shard files it wrote; rank 0 adds the rest and writes ``checksums.json``."""
        import torch.distributed as dist

        rank = self.global_rank
        own = checksums.digests(path, checksums.own_shard_files(path, rank))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, own)
        else:
            gathered = [own]
        if self.is_global_zero:
            files = {name: digest for part in gathered for name, digest in part.items()}
            files.update(checksums.digests(path, [".metadata", _METADATA_FILENAME]))
            checksums.write_checksums(path, files)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        # again here: a run started without the launcher's check gets the same one line. Rank 0 checks (the
        # launcher's process: its verified checksums are remembered) and tells the others
        problem = None
        if self.is_global_zero:
            try:
                check_checkpoint(path)
            except CheckpointError as e:
                problem = str(e)
        problem = self.broadcast(problem)
        if problem is not None:
            raise CheckpointError(problem)
        if path.is_file():
            return load_lightning_file(self, path, weights_only)
        saved = {k.split(".", 1)[0] for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata}
        model_key = MODEL_KEY if MODEL_KEY in saved else _LEGACY_MODEL_KEY
        module = self.lightning_module
        optimizers = [_unwrap(o) for o in self.optimizers] if "optimizer_0" in saved else []
        templates: dict[str, Any] = {model_key: get_model_state_dict(module)}
        # QLoRA's frozen NF4 base is not read back: it is the same weights materialise already gave it (the pretrained
        # checkpoint's, or the seed's), and the checkpoint holds their dequantized values
        frozen = [k for k, v in templates[model_key].items() if is_nf4(v)]
        for key in frozen:
            templates[model_key].pop(key)
        for i, opt in enumerate(optimizers):
            templates[f"optimizer_{i}"] = self.optimizer_state_template(opt)
        # as saved: packed TP weights replicated over tp. Only then is a copy loaded into and scattered back:
        # DCP fills the structure it is given in place, and an optimizer's param_groups loaded into a copy lost
        # keys the template holds (SGD's momentum, a pipeline resumed in another cut)
        packed = has_packed(templates)
        loadable = gather_packed(templates) if packed else templates
        try:
            dcp.load(loadable, checkpoint_id=path)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's own error is a BaseException
            raise CheckpointError(f"cannot load checkpoint {path} (damaged shard files, or a model it does not fit): "
                                  f"{_cause(e)}") from None
        if packed:
            templates = scatter_packed(loadable, templates)
        set_model_state_dict(module, templates[model_key],
                             options=StateDictOptions(strict=getattr(module, "strict_loading", True) and not frozen))
        for i, opt in enumerate(optimizers):
            self.load_optimizer_state(opt, templates[f"optimizer_{i}"])
        meta_file = path / _METADATA_FILENAME
        try:
            meta = torch.load(meta_file, map_location="cpu", weights_only=True if weights_only is None else weights_only)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint file {meta_file} is damaged or not safely loadable: {_cause(e)}") from None
        self.barrier()
        return meta

    # ------------------------------------------------- hooks for non-canonical optimizers
    def checkpoint_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's part of the optimizer state in the canonical layout (collective)."""
        return get_optimizer_state_dict(self.lightning_module, optimizer)

    def optimizer_state_template(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Tensors, in the canonical layout, that DCP loads this rank's optimizer state into."""
        return get_optimizer_state_dict(self.lightning_module, optimizer)  # creates the state if absent

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.lightning_module, optimizer, state)

    # ------------------------------------------------------------------ loop state
    def process_dataloader(self, dataloader: object) -> object:
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or not trainer.training or not hasattr(dataloader, "batch_size"):
            return dataloader
        if getattr(dataloader, "batch_size", None) is None or not hasattr(dataloader, "__len__"):
            return dataloader
        dp_size = int((getattr(self, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1))
        return ResumableLoader(dataloader, dp_size)


def save_failure(path: Path, exc: BaseException) -> str:
    """One line for a checkpoint save that failed: the cause, the directory, its free space and what a
    checkpoint of this run takes (its newest complete sibling's size on disk, when there is one)."""
    cause = _cause(exc)
    line = f"cannot save checkpoint {path}: {cause}; the partial checkpoint was removed"
    parent = path.parent
    try:
        free = shutil.disk_usage(parent).free
    except OSError:
        return line
    sizes = []
    for sibling in parent.glob("*.ckpt"):
        if sibling != path and is_sharded_checkpoint(sibling):
            sizes.append((sibling.stat().st_mtime, sum(f.stat().st_size for f in sibling.iterdir() if f.is_file()),
                          sibling.name))
    need = f"; a checkpoint of this run takes {fmt_bytes(max(sizes)[1])} ({max(sizes)[2]})" if sizes else ""
    return f"{line}. {parent} has {fmt_bytes(free)} free{need}"


def lightning_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A loaded sharded checkpoint (DCP payload + meta.pt) in the layout of Lightning's own file: the
    model under ``state_dict``; the optimizer states (canonical, keyed by name) dropped."""
    out = {k: v for k, v in checkpoint.items() if not k.startswith("optimizer_")}
    if MODEL_KEY in out:
        out[_LEGACY_MODEL_KEY] = out.pop(MODEL_KEY)
    return out


def export_facts(module: nn.Module) -> dict[str, Any]:
    """What ``lightning-par-export`` needs beside the tensors: a Hugging Face model's config and where it
    sits in the module (any LightningModule holding one), a LoRA run's rank and alpha (to merge or write
    its adapters, ``lora_export.py``), and the run's tokenizer directory if its data has one."""
    out: dict[str, Any] = {}
    found = find_hf_model(module)
    if found is not None:
        path, net = found
        out["hf_config"] = plain(net.config.to_dict())
        out["hf_module_prefix"] = f"{canonical_name(path)}." if path else ""
    lora = facts_of_module(module)
    if lora is not None:
        out["lora"] = lora
    trainer = getattr(module, "_trainer", None)
    tokenizer = getattr(getattr(trainer, "datamodule", None), "tokenizer_dir", None)
    if tokenizer:
        out["tokenizer_dir"] = str(tokenizer)
    return out


def module_fqns(module: nn.Module) -> dict[nn.Parameter, str]:
    """Parameter -> canonical FQN."""
    return {p: canonical_fqn(n) for n, p in module.named_parameters()}


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


__all__ = ["CheckpointError", "DistributedCheckpointMixin", "ResumableLoader", "canonical_fqn", "check_checkpoint",
           "initialize_optimizer_state", "is_sharded_checkpoint", "module_fqns", "plain"]
