"""The strategy catalogue: every strategy declared once.

An entry names the strategy (``strategy=<name>`` picks ``conf/strategy/<name>.yaml``; Lightning's
registry knows it as ``lp_<name>``), its class, the arguments a preset fixes, the mesh axes it may
use, what each rank holds (``Sharding``), which traffic model prices its collectives
(``costs/comm.py``) and which plans the advisor may propose with it. Everything else is derived
from here: Lightning's ``StrategyRegistry`` (``registry.py``), ``mode=estimate``'s rows and the
strategy it reads off a built instance (``costs/estimate.py``), the cost layout the estimator and the
comm model price (``StrategyEntry.cost_layout``), and the advisor's candidates (``costs/advisor.py``).
Defaults are the class constructor's (``StrategyEntry.defaults``); ``tests/test_catalog.py`` checks
that each yaml agrees with them.

Adding a strategy (docs/architecture.md, "Add a strategy"): one entry below, one thin class, one
yaml, and a parity test. Plain Python: classes are named by import path and loaded on first use,
so the estimator and the advisor can read the catalogue without building a strategy.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from lightning_par.parallel.layout import GRAD_MODES, Layout, Sharding

__all__ = ["CATALOG", "GRAD_MODES", "Fleet", "Layout", "Option", "Sharding", "StrategyEntry", "entry", "entry_of"]

@dataclass(frozen=True)
class Fleet:
    """What the advisor knows when it asks an entry for plans."""

    devices: int
    devices_per_node: int
    nodes: int
    n_experts: int = 0  # routed experts per MoE layer; 0: a dense model
    optimizer: str = "adamw"


@dataclass(frozen=True)
class Option:
    """One plan the advisor may price: config overrides and the matching ``cost_layout`` arguments."""

    overrides: tuple[str, ...] = ()
    layout: Mapping[str, Any] = field(default_factory=dict)
    optimizer: str | None = None  # another optimizer than the run's (8-bit AdamW states)


@dataclass(frozen=True)
class StrategyEntry:
    """One strategy. ``target``: ``"module:Class"``; ``preset``: constructor arguments the entry fixes
    (``hsdp`` is fsdp with ``replicate=2``); ``axes``: mesh axes it may build (empty: one device);
    ``sharding``: per ``data_parallel`` value where the class takes one, else a single ``Sharding``;
    ``comm``: the traffic model of ``costs/comm.py``; ``advise``: the plans the advisor may propose
    (None: never proposed), tried in ``preference`` order; ``layout``: a cost layout of its own
    where ``Sharding`` cannot say it (expert parallelism); ``family``: a row of ``mode=estimate``'s
    data-parallel table."""

    name: str
    target: str
    description: str
    axes: tuple[str, ...]
    sharding: Sharding | Mapping[str, Sharding]
    comm: str
    preset: Mapping[str, Any] = field(default_factory=dict)
    family: bool = False
    advise: Callable[[Fleet], list[Option]] | None = None
    preference: int = 100
    layout: Callable[..., Layout] | None = None

    @property
    def registry_name(self) -> str:
        return f"lp_{self.name}"

    @property
    def yaml(self) -> str:
        """Path of its config, relative to the package."""
        return f"conf/strategy/{self.name}.yaml"

    def strategy_class(self) -> type:
        module, _, cls = self.target.partition(":")
        return getattr(importlib.import_module(module), cls)

    def defaults(self) -> dict[str, Any]:
        """The constructor's defaults with the preset's arguments over them: the one source of every
        default (the yaml repeats them for the reader; tests/test_catalog.py keeps it honest)."""
        out: dict[str, Any] = {}
        for cls in self.strategy_class().__mro__:  # a constructor's **kwargs reach its parent's
            params = inspect.signature(cls.__init__).parameters
            for k, p in params.items():
                if k != "self" and k not in out and p.default is not inspect.Parameter.empty:
                    out[k] = p.default
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                break
        return {**out, **self.preset}

    def sharding_for(self, data_parallel: str | None) -> Sharding:
        if isinstance(self.sharding, Sharding):
            return self.sharding
        if data_parallel not in self.sharding:
            raise ValueError(f"{self.name}: data_parallel must be one of {', '.join(self.sharding)}, "
                             f"got {data_parallel!r}")
        return self.sharding[data_parallel]

    def cost_layout(self, devices: int, *, tp: int | None = None, pp: int | None = None,
                    replicate: int | None = None, data_parallel: str | None = None, ep: int | None = None,
                    **options: Any) -> Layout:
        """What a rank holds on ``devices`` ranks. ``tp``/``pp``/``replicate``/``data_parallel``/``ep``
        as the constructor takes them (None: its default); ``options``: further ``Layout`` fields
        (``cpu_offload`` adds to the entry's own)."""
        d = self.defaults()
        data_parallel = data_parallel if data_parallel is not None else d.get("data_parallel", "replicate")
        if self.layout is not None:
            return self.layout(self, devices, ep=ep, data_parallel=data_parallel, **options)
        if ep is not None and ep > 1:
            raise ValueError(f"the estimator prices expert parallelism with strategy=expert_parallel only, not "
                             f"ep={ep} with {self.name}")
        n = devices if self.axes else 1
        tp = tp if tp is not None else ((d.get("tp") or n) if "tp" in self.axes else 1)
        pp = pp if pp is not None else ((d.get("pp") or n) if "pp" in self.axes else 1)
        replicate = replicate if replicate is not None else int(d.get("replicate", 1))
        if n % (tp * pp):
            raise ValueError(f"{self.name}: tp={tp} x pp={pp} does not divide the world size {n}")
        dp = n // (tp * pp)
        sh = self.sharding_for(data_parallel)
        if replicate < 1 or dp % replicate:
            raise ValueError(f"{self.name}: replicate={replicate} does not divide the data-parallel size {dp}")
        shard = dp // replicate if sh.grads in ("fsdp", "zero2") or sh.optimizer else 1
        mesh = {k: v for k, v in (("pp", pp), ("dp_replicate", dp // max(1, shard)), ("dp_shard", shard), ("tp", tp))
                if v > 1} or {"dp_shard": 1}
        return Layout(strategy=self.name, shard=max(1, shard), params_sharded=sh.params, opt_sharded=sh.optimizer,
                      grads=sh.grads, cpu_offload=sh.cpu_offload or bool(options.pop("cpu_offload", False)), tp=tp,
                      pp=pp, mesh=mesh, data_parallel=data_parallel, **options)


# ------------------------------------------------------------------------------ layouts of their own
def _expert_parallel_layout(e: StrategyEntry, devices: int, *, ep: int | None, data_parallel: str,
                            **options: Any) -> Layout:
    """The routed experts split over ``ep`` ranks (None: every rank); the rest replicated
    (``replicate``: gradients all-reduced after backward) or, with ``fsdp``, the non-expert
    parameters sharded over the whole world and the experts' own shards over dp = world / ep (none
    when ep is the whole world: the experts stay ep shards outside FSDP)."""
    ep = ep or devices
    if ep < 1 or devices % ep:
        raise ValueError(f"expert_parallel: ep={ep} does not divide the world size {devices}")
    dp = devices // ep
    sh = e.sharding_for(data_parallel)
    if sh.grads == "fsdp":
        return Layout(strategy=e.name, shard=devices, params_sharded=True, opt_sharded=True, grads="fsdp", ep=ep,
                      expert_shard=dp, mesh={k: v for k, v in (("dp_shard", dp), ("ep", ep)) if v > 1},
                      data_parallel=data_parallel, **options)
    return Layout(strategy=e.name, grads=sh.grads, ep=ep, data_parallel=data_parallel,
                  mesh={k: v for k, v in (("dp_replicate", dp), ("ep", ep)) if v > 1}, **options)


# ------------------------------------------------------------------------------ the advisor's plans
def _one_device(f: Fleet) -> list[Option]:
    if f.devices != 1:
        return []
    out = [Option()]
    if f.optimizer in ("adamw", "adam"):  # fit before distributing: 8-bit optimizer states (torchao)
        out.append(Option(("model.optimizer=adamw8bit",), optimizer="adamw8bit"))
    return out


def _many_devices(f: Fleet) -> list[Option]:
    return [Option()] if f.devices > 1 else []


def _across_nodes(f: Fleet) -> list[Option]:
    if f.devices == 1 or f.nodes == 1:
        return []
    return [Option((f"strategy.replicate={f.nodes}",), {"replicate": f.nodes})]


def _experts_within_a_node(f: Fleet) -> list[Option]:
    """ep = the largest divisor of the expert count that fits in a node (its all-to-all stays on the
    fast links), the rest replicated or FSDP-sharded."""
    if f.devices == 1 or not f.n_experts:
        return []
    ep = max(k for k in range(1, min(f.devices_per_node, f.n_experts) + 1)
             if f.n_experts % k == 0 and f.devices % k == 0)
    if ep == 1:
        return []
    # with fsdp and ep = the world the experts stay ep shards outside FSDP and the rest is sharded over
    # every rank (strategies/expert_parallel.py): offered too
    return [Option((f"strategy.ep={ep}", f"strategy.data_parallel={dp}"), {"ep": ep, "data_parallel": dp})
            for dp in ("replicate", "fsdp")]


def _tp_within_a_node(f: Fleet) -> list[Option]:
    # TP of an MoE model is not priced: its MoE layers run whole on every tp rank
    if f.devices == 1 or f.devices_per_node == 1 or f.n_experts:
        return []
    return [Option((f"strategy.tp={f.devices_per_node}",), {"tp": f.devices_per_node})]


def _tp_within_pp_across_nodes(f: Fleet) -> list[Option]:
    """TP within a node, pipeline stages across nodes: every pp that divides the node count (the
    rest of the nodes are data parallel)."""
    if not _tp_within_a_node(f) or f.nodes == 1:
        return []
    return [Option((f"strategy.tp={f.devices_per_node}", f"strategy.pp={pp}"), {"tp": f.devices_per_node, "pp": pp})
            for pp in range(2, f.nodes + 1) if f.nodes % pp == 0]


def _always(f: Fleet) -> list[Option]:
    return [Option()]


# ------------------------------------------------------------------------------ the catalogue
_S = "lightning_par.strategies"
REPLICATED, BUCKETED = Sharding(), Sharding(grads="bucket")
FULLY_SHARDED = Sharding(params=True, optimizer=True, grads="fsdp")

CATALOG: tuple[StrategyEntry, ...] = (
    StrategyEntry("single", f"{_S}.single:SingleDeviceStrategy", "one device, the reference run", (), REPLICATED,
                  "none", family=True, advise=_one_device, preference=0),
    StrategyEntry("ddp", f"{_S}.ddp:DDPStrategy", "data parallel (DistributedDataParallel)", ("dp_replicate",),
                  BUCKETED, "all_reduce", family=True, advise=_many_devices, preference=1),
    StrategyEntry("zero1", f"{_S}.zero:Zero1Strategy", "ZeRO-1: optimizer state sharded", ("dp_shard",),
                  Sharding(optimizer=True, grads="bucket"), "zero1", family=True, advise=_many_devices, preference=2),
    StrategyEntry("zero2", f"{_S}.zero:Zero2Strategy", "ZeRO-2: optimizer state and gradients sharded",
                  ("dp_shard",), Sharding(optimizer=True, grads="zero2"), "zero2", family=True, advise=_many_devices,
                  preference=3),
    StrategyEntry("zero3", f"{_S}.zero:Zero3Strategy", "ZeRO-3: FSDP2, everything sharded", ("dp_shard",),
                  FULLY_SHARDED, "fsdp", family=True),  # priced like fsdp: the advisor proposes fsdp
    StrategyEntry("zero3_offload", f"{_S}.zero:Zero3OffloadStrategy", "ZeRO-3 with CPU offload", ("dp_shard",),
                  Sharding(params=True, optimizer=True, grads="fsdp", cpu_offload=True), "fsdp", family=True,
                  advise=_always, preference=90),
    StrategyEntry("fsdp", f"{_S}.fsdp:FSDPStrategy", "FSDP2 with every knob", ("dp_replicate", "dp_shard"),
                  FULLY_SHARDED, "fsdp", family=True, advise=_many_devices, preference=4),
    StrategyEntry("hsdp", f"{_S}.fsdp:FSDPStrategy", "hybrid sharding: FSDP within 2 replica groups",
                  ("dp_replicate", "dp_shard"), FULLY_SHARDED, "fsdp", preset=MappingProxyType({"replicate": 2}),
                  advise=_across_nodes, preference=10),
    StrategyEntry("pipeline", f"{_S}.pipeline:PipelineStrategy", "pipeline parallel over the model's declared layers",
                  ("pp", "dp_replicate", "ep"), REPLICATED, "pipeline"),
    StrategyEntry("tensor_parallel", f"{_S}.tensor_parallel:TensorParallelStrategy",
                  "tensor parallel from the model's tp plan", ("dp_replicate", "tp", "ep"), REPLICATED,
                  "tensor_parallel"),
    StrategyEntry("fsdp_tp", f"{_S}.composite:FSDPTPStrategy", "2-D: tensor parallel x FSDP", ("dp_shard", "tp", "ep"),
                  FULLY_SHARDED, "fsdp_tp", advise=_tp_within_a_node, preference=30),
    StrategyEntry("3d", f"{_S}.composite:Parallel3DStrategy", "3-D: pipeline x tensor x data parallel",
                  ("pp", "dp_replicate", "dp_shard", "tp", "ep"),
                  MappingProxyType({"fsdp": FULLY_SHARDED, "replicate": REPLICATED}), "3d",
                  advise=_tp_within_pp_across_nodes, preference=40),
    StrategyEntry("expert_parallel", f"{_S}.expert_parallel:ExpertParallelStrategy",
                  "MoE experts over an ep axis (all-to-all) x data parallel", ("dp_replicate", "dp_shard", "ep"),
                  MappingProxyType({"fsdp": FULLY_SHARDED, "replicate": REPLICATED}), "expert_parallel",
                  advise=_experts_within_a_node, preference=20, layout=_expert_parallel_layout),
)


def entry(name: str) -> StrategyEntry:
    """The entry of a config name (``zero3``) or registry name (``lp_zero3``)."""
    key = name.removeprefix("lp_")
    for e in CATALOG:
        if e.name == key:
            return e
    raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(e.name for e in CATALOG)}")


def entry_of(strategy: Any) -> StrategyEntry | None:
    """The entry a built strategy instance is: its class's entries, the one whose preset arguments
    its attributes match most specifically (an FSDPStrategy with replicate=2 is ``hsdp``)."""
    matches = [e for e in CATALOG if e.target.rpartition(":")[2] == type(strategy).__name__
               and all(getattr(strategy, k, None) == v for k, v in e.preset.items())]
    return max(matches, key=lambda e: len(e.preset), default=None)
