"""Resuming a Lightning single-file checkpoint (``Trainer(strategy="ddp")``'s ``.ckpt``) under an lp_ strategy.

Lightning's own strategies write one ``torch.save`` file: the model's full ``state_dict`` keyed by
parameter name, and each optimizer's ``state_dict`` in torch's layout, keyed by the parameter's
position in the optimizer's groups. lightning_par's checkpoints are DCP directories in the canonical
layout (keyed by name, any sharding). The file is turned into what DCP would have handed over:

- the model: each rank copies its piece of every full tensor into its own (FSDP's DTensor shards,
  full tensors elsewhere), without a collective;
- each optimizer: positions mapped to names through the current optimizer's groups (the same
  ``configure_optimizers`` builds them in the same order) or, for one group holding every parameter,
  the module's parameter order; then each tensor of the strategy's own state template (its
  ``optimizer_state_template``: DTensors, full tensors, owned parameters) is filled with its slice of
  the full one, and loaded through the strategy's ``load_optimizer_state`` as a DCP load would be;
- everything else (loops, callbacks, schedulers, hyper-parameters) goes back to Lightning as is.

Every rank reads the file (memory-mapped: the pages each touches). A pipeline rank holds only its
stages' parameters: its positions come from the whole model's parameter order, recorded before the
cut (``full_parameter_names``), which maps an optimizer of one group of every parameter. A file whose
optimizer cannot be mapped (several groups under a pipeline; groups that changed) is one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch import nn

from lightning.pytorch.core.optimizer import LightningOptimizer

from lightning_par.parallel.init.materialize import canonical_name as canonical_fqn
from lightning_par.strategies.checkpoint.errors import CheckpointError, _cause


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def check_lightning_file(path: Path) -> None:
    """One line unless ``path`` is a readable Lightning checkpoint file with a model state."""
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True)  # torch's safe default: tensors and plain data
    except Exception as e:  # noqa: BLE001 - truncated zip, empty file: all unreadable
        raise CheckpointError(f"checkpoint file {path} is not a readable Lightning checkpoint: {_cause(e)}") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"checkpoint file {path} holds no state_dict (not a Lightning checkpoint)")


def load_lightning_file(strategy: Any, path: Path, weights_only: bool | None) -> dict[str, Any]:
    """Load ``path`` into ``strategy``'s model and optimizers; returns the rest for Lightning."""
    check_lightning_file(path)
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)  # None: torch's default
    module = strategy.lightning_module
    targets = {canonical_fqn(n): t for n, t in module.state_dict(keep_vars=True).items()}
    state = {canonical_fqn(k): v for k, v in checkpoint.pop("state_dict").items()}
    missing = sorted(set(targets) - set(state))
    if missing:
        raise CheckpointError(f"checkpoint file {path} has no {missing[0]} (and {len(missing) - 1} more): "
                              "saved from another model")
    with torch.no_grad():  # each rank copies its own piece of every full tensor: no collective
        for name, target in targets.items():
            if tuple(target.shape) != tuple(state[name].shape):
                raise CheckpointError(f"checkpoint file {path}: {name} has shape {tuple(state[name].shape)}, "
                                      f"the model's is {tuple(target.shape)}")
            _fill(target, state[name], path)
    saved = checkpoint.pop("optimizer_states", []) or []
    optimizers = [_unwrap(o) for o in strategy.optimizers]
    if saved and len(saved) != len(optimizers):
        raise CheckpointError(f"checkpoint file {path} holds {len(saved)} optimizer states; the run has {len(optimizers)}")
    whole = getattr(strategy, "full_parameter_names", None)
    for opt, torch_state in zip(optimizers, saved):
        full = _by_name(torch_state, opt, module, path, whole)
        template = strategy.optimizer_state_template(opt)
        _fill(template, full, path)
        strategy.load_optimizer_state(opt, template)
    strategy.barrier()
    return checkpoint


def _by_name(torch_state: dict[str, Any], optimizer: torch.optim.Optimizer, module: nn.Module,
             path: Path, whole: list[str] | None = None) -> dict[str, Any]:
    """Torch's position-keyed optimizer state as the canonical name-keyed one (full tensors). ``whole``:
    the whole model's parameter names in order, where this rank holds only a part (a pipeline stage)."""
    fqn = {id(p): canonical_fqn(n) for n, p in module.named_parameters()}
    saved_groups = torch_state["param_groups"]
    if all(isinstance(i, str) for g in saved_groups for i in g["params"]):
        return torch_state  # already keyed by name (a file consolidated from one of our checkpoints)
    current = [[fqn.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
    if [len(g) for g in current] == [len(g["params"]) for g in saved_groups] and all(n for g in current for n in g):
        order = current
    elif len(saved_groups) == 1 and len(saved_groups[0]["params"]) == len(
            names := list(whole or (canonical_fqn(n) for n, _ in module.named_parameters()))):
        order = [names]  # one group of every parameter of the whole model (a pipeline rank holds some)
    else:
        raise CheckpointError(f"checkpoint file {path}: its optimizer's {[len(g['params']) for g in saved_groups]} "
                              "parameters per group do not map onto this run's (a pipeline rank holds only its "
                              "stages', which map only from one group of every parameter; resume such a file "
                              "under ddp, zero1-3 or fsdp)")
    names = {i: n for g, group in zip(saved_groups, order) for i, n in zip(g["params"], group)}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": group} for g, group in zip(saved_groups, order)]
    return {"state": {names[i]: s for i, s in torch_state["state"].items()}, "param_groups": groups}


def _fill(template: Any, full: Any, path: Path, where: str = "") -> None:
    """Copy ``full``'s values into ``template``'s tensors, each its local piece (a DTensor's shard)."""
    if isinstance(template, dict):
        if where == "state." and isinstance(full, dict):  # parameters that never stepped have no saved state:
            for key in [k for k in template if k not in full]:  # they keep the fresh state, as in Lightning
                del template[key]
        for key, value in template.items():
            if key == "param_groups" and isinstance(full, dict) and "param_groups" in full:
                for mine, saved in zip(value, full["param_groups"]):  # the saved hyper-parameters (lr as stepped)
                    mine.update({k: v for k, v in saved.items() if k != "params"})
                continue
            if not isinstance(full, dict) or key not in full:
                raise CheckpointError(f"checkpoint file {path} has no optimizer state {where}{key}")
            if isinstance(value, (dict, torch.Tensor)):
                _fill(value, full[key], path, f"{where}{key}.")
            else:
                template[key] = full[key]
        return
    if not isinstance(template, torch.Tensor):
        return
    source = torch.as_tensor(full).to(template.dtype)
    if source.numel() > 1 and tuple(source.shape) != tuple(template.shape):  # a DTensor's shape is the global one
        raise CheckpointError(f"checkpoint file {path}: optimizer state {where.rstrip('.')} has shape "
                              f"{tuple(source.shape)}, this run's has {tuple(template.shape)} (groups in another order?)")
    if isinstance(template, DTensor):
        piece = distribute_tensor(source.to(template.device), template.device_mesh, template.placements,
                                  src_data_rank=None)
        template.to_local().copy_(piece.to_local())
    else:
        template.copy_(source.reshape(template.shape))
