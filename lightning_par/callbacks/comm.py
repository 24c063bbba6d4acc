"""``CommMonitor``: every collective a training step issues, counted from the run itself.

Method: a ``TorchDispatchMode`` is active from the start to the end of a few training batches
after warm-up. Every process-group operation goes through torch's op registry -- ``c10d.*`` ops
from ``torch.distributed`` calls (DDP's reducer, FSDP2's all-gather / reduce-scatter, ZeRO's
broadcasts and collectives, pipelining's send/recv) and ``_c10d_functional.*`` ops from DTensor
(tensor parallelism) -- so the mode sees them, including those issued from autograd hooks
(dispatch modes are part of the thread-local state autograd carries into backward). This is the
mechanism of ``torch.distributed.tensor.debug.CommDebugMode``; it is not used directly because
it keeps only call counts (no payload bytes, no process group) and ignores send/recv.

Payload is the full logical tensor of each collective (``costs/comm.py``'s definition); every
call's process group is mapped to the mesh axis with the same ranks (``world`` if none). RunGuard
runs after this callback (``train.with_guard`` puts it last), so its flag all-reduce falls outside
the measured window; calls inside it made from lightning_par's callbacks or Lightning's logging are
counted apart, under ``bookkeeping``. Summary key ``comm``: bytes per step by kind and axis (each
entry the largest over ranks), each rank's figures, call counts, the steps measured and the method.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

METHOD = ("TorchDispatchMode over c10d and _c10d_functional ops (CommDebugMode's mechanism, with payload "
          "bytes and process groups), active for the measured training batches on every rank")

# op name -> (kind, which argument holds the payload: "out" first tensor list/arg, "in" second ...)
_C10D = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0), "reduce_": ("reduce", 0), "gather_": ("gather", 1), "scatter_": ("scatter", 0),
    "send": ("send", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0),
}
_FUNCTIONAL = {  # DTensor's functional collectives: payload from the input (x group size for gathers)
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "broadcast_": "broadcast",
}
# frames whose collectives are the tool's own, not the strategy's
_BOOKKEEPING = ("lightning_par/callbacks/", "logger_connector", "trainer/connectors/", "/loops/")


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _bookkeeping() -> bool:
    """True when the innermost lightning_par / Lightning frame that issued this call is bookkeeping."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename == __file__:
        f = f.f_back
    while f is not None:
        name = f.f_code.co_filename.replace("\\", "/")
        if "lightning_par/" in name or "lightning/pytorch/" in name:
            return any(tag in name for tag in _BOOKKEEPING) and "lightning_par/parallel" not in name
        f = f.f_back
    return False


class _Recorder(TorchDispatchMode):
    """Adds up (kind, process group) -> bytes and calls for the c10d / functional ops it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[tuple[str, Any, bool], int] = defaultdict(int)
        self.calls: dict[tuple[str, Any, bool], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            # let DTensor desugar into functional collectives first (they come back here); any other
            # subclass (FakeTensor in DTensor's sharding propagation, Parameter) just runs below
            return NotImplemented
        out = func(*args, **kwargs)
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns == "c10d" and name in _C10D:
            kind, i = _C10D[name]
            group = next((a for a in args if isinstance(a, (dist.ProcessGroup, torch.ScriptObject))), None)
            key = (kind, _ranks(group), _bookkeeping())
            self.bytes[key] += _nbytes(args[i])
            self.calls[key] += 1
        elif ns == "_c10d_functional" and name in _FUNCTIONAL:
            kind = _FUNCTIONAL[name]
            group_name = args[-1] if isinstance(args[-1], str) else kwargs.get("group_name")
            group = dist.distributed_c10d._resolve_process_group(group_name) if group_name else None
            n = _nbytes(args[0]) * (dist.get_world_size(group) if kind == "all_gather" and group else 1)
            key = (kind, _ranks(group), _bookkeeping())
            self.bytes[key] += n
            self.calls[key] += 1
        return out


def _ranks(group: Any) -> tuple[int, ...] | None:
    if isinstance(group, torch.ScriptObject):  # c10d ops carry the group boxed
        group = dist.ProcessGroup.unbox(group)
    if group is None:
        return None
    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a group this rank is not part of; counted under "world"
        return None


def axis_groups(strategy: Any, world_size: int) -> dict[tuple[int, ...], str]:
    """Ranks of this rank's group on every mesh axis -> axis name (``mesh_sizes`` order)."""
    out: dict[tuple[int, ...], str] = {}
    mesh = getattr(strategy, "device_mesh", None)
    names = list(getattr(mesh, "mesh_dim_names", None) or ())
    for name in names + (["dp"] if {"dp_replicate", "dp_shard"} <= set(names) else []):
        try:
            out.setdefault(tuple(dist.get_process_group_ranks(mesh[name].get_group())), name)
        except Exception:  # noqa: BLE001 - a flattened axis this torch cannot slice
            continue
    sizes = getattr(strategy, "mesh_sizes", None) or {"dp_replicate": world_size}
    if len(sizes) == 1:  # a one-axis strategy without a DeviceMesh (ddp, zero1): the world group
        out.setdefault(tuple(range(world_size)), next(iter(sizes)))
    return out


class CommMonitor(L.Callback):
    """Counts collective payload per training step over ``measure_steps`` batches after ``warmup_steps``.

    Args:
        warmup_steps: optimizer steps left out first (lazy initialisation and pipeline shape exchange in
            step 0, DDP's bucket rebuild -- a broadcast of bucket indices -- in step 1). Every op
            of a measured step goes through Python, so measure inside the throughput monitor's warm-up.
        measure_steps: steps measured; their mean is reported (fewer when the run is shorter).
    """

    def __init__(self, warmup_steps: int = 2, measure_steps: int = 1) -> None:
        self.warmup_steps = warmup_steps
        self.measure_steps = measure_steps
        self._mode: _Recorder | None = None
        self._recorded: list[_Recorder] = []
        self._steps: list[int] = []
        self._axes: dict[tuple[int, ...], str] = {}
        self._step_at_start = -1
        self.result: dict[str, Any] | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._recorded, self._steps, self.result = [], [], None
        if dist.is_available() and dist.is_initialized():
            self._axes = axis_groups(trainer.strategy, trainer.world_size)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        if self._mode is None and trainer.global_step >= self.warmup_steps and len(self._steps) < self.measure_steps:
            self._mode = _Recorder()
            self._mode.__enter__()
            self._step_at_start = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._mode is not None and trainer.global_step != self._step_at_start:  # the optimizer stepped
            self._mode.__exit__(None, None, None)
            self._recorded.append(self._mode)
            self._steps.append(self._step_at_start)
            self._mode = None

    def _drop_partial(self) -> None:
        if self._mode is not None:  # a run that ended inside a measured window: drop the partial step
            self._mode.__exit__(None, None, None)
            self._mode = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._drop_partial()  # never leave the mode on after a failed step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._drop_partial()
        local = self._local_figures()
        ranks = [local]
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, local)  # once, after the measured steps
        self.result = _combine(ranks, self._steps)

    def _local_figures(self) -> dict[str, Any]:
        n = max(1, len(self._recorded))
        per: dict[str, dict[str, dict[str, float]]] = {"strategy": {}, "bookkeeping": {}, "calls": {}}
        for rec in self._recorded:
            for (kind, ranks, own), nbytes in rec.bytes.items():
                axis = self._axes.get(ranks, "world") if ranks is not None else "world"
                part = per["bookkeeping" if own else "strategy"].setdefault(kind, {})
                part[axis] = part.get(axis, 0) + nbytes / n
                if not own:
                    calls = per["calls"].setdefault(kind, {})
                    calls[axis] = calls.get(axis, 0) + rec.calls[(kind, ranks, own)] / n
        return {"rank": dist.get_rank() if dist.is_initialized() else 0, **per}

    def summary(self) -> dict[str, Any]:
        return {"comm": self.result}


def _combine(ranks: list[dict[str, Any]], steps: list[int]) -> dict[str, Any]:
    top: dict[str, dict[str, int]] = {}
    for r in ranks:
        for kind, axes in r["strategy"].items():
            for axis, nbytes in axes.items():
                entry = top.setdefault(kind, {})
                entry[axis] = max(entry.get(axis, 0), int(round(nbytes)))
    per_rank = [{"rank": r["rank"], "bytes": {k: {a: int(round(v)) for a, v in ax.items()} for k, ax in r["strategy"].items()},
                 "calls": {k: {a: round(v, 2) for a, v in ax.items()} for k, ax in r["calls"].items()},
                 "bookkeeping": {k: {a: int(round(v)) for a, v in ax.items()} for k, ax in r["bookkeeping"].items()}}
                for r in ranks]
    by_axis: dict[str, int] = {}
    for axes in top.values():
        for axis, nbytes in axes.items():
            by_axis[axis] = by_axis.get(axis, 0) + nbytes
    return {"bytes_per_step": top, "by_axis": by_axis, "total_bytes_per_step": sum(by_axis.values()),
            "steps_measured": steps, "per_rank": per_rank, "payload": "full logical tensor (costs/comm.py)",
            "method": METHOD}
