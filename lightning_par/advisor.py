"""Strategy advisor: which strategy for this model on this cluster, and the command that runs it.

Every candidate is priced by the cost model (``lightning_par.estimate``: per-rank *peak* of a step,
activations and transients included) and by the communication model (``lightning_par.costs.comm``:
payload bytes per step and rank, by collective and mesh axis; time = bytes x bus factor / link
bandwidth, the within-node bandwidth for axes inside a node and the between-node one for axes that
span nodes). A plan "fits" when its predicted peak is within ``headroom`` of device memory; the
advisor never recommends one that does not (it says so and exits non-zero instead).

The candidates are the strategy catalogue's (``strategies/catalog.py``): each entry says which plans
it offers on a cluster (``StrategyEntry.advise``) and in which order they are tried
(``preference``). The decision tree (the field's standard notes):

1. the whole step fits one device -> ``single`` (one device) or ``ddp``; on one device the next try
   is 8-bit optimizer states (``model.optimizer=adamw8bit``, torchao's AdamW8bit: 2 bytes of state
   per parameter instead of 8) before anything is offloaded;
2. else the least sharding that fits: ``zero1`` -> ``zero2`` -> ``fsdp`` (ZeRO-3), then ``hsdp``
   (shard within a node) and the model-parallel cuts ``fsdp_tp`` (TP within a node) and ``3d``
   (TP within nodes, pipeline stages across nodes). On several nodes with slow links the fitting
   candidate with the least predicted communication time wins;
3. nothing fits, or a single layer is too large to all-gather: ZeRO-3 with CPU offload
   (``zero3_offload``), and memory-centric tiling (``strategy.tiling``) of every linear whose FSDP
   unit does not fit; the embedding cannot be tiled, so a vocabulary too large for one device goes
   to tensor parallelism within a node.

Mixture-of-experts models add expert parallelism (``expert_parallel``, ep = the largest divisor of
the expert count within a node, the rest replicated or FSDP): when the step fits every device the
experts are replicated (ddp: its all-reduce overlaps backward, the all-to-all of tokens would sit
on every MoE layer's critical path); otherwise the fitting plan with the least predicted
communication time wins -- expert parallelism trades the experts' all-reduce or all-gathers for an
all-to-all of the routed tokens, which wins when the experts are large next to the tokens routed.
The cost model does not price tensor parallelism of an MoE model (its MoE layers run whole on every
tp rank), so fsdp_tp / 3d are not offered for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_par.costs import comm as comm_model
from lightning_par.costs.activations import Shape, dtypes
from lightning_par.estimate import GIB, MemoryEstimate, bytes_per_param, estimate, layout
from lightning_par.strategies.catalog import CATALOG, Fleet

TILES = (2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    devices_per_node: int = 8
    device_memory_gb: float = 80.0  # GiB per device
    intra_node_gbs: float = 300.0  # GB/s per device within a node (NVLink-class)
    inter_node_gbs: float = 25.0  # GB/s per device between nodes (InfiniBand-class; Ethernet: ~3)

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass
class Candidate:
    strategy: str
    overrides: list[str]
    memory: MemoryEstimate
    comm_bytes: int
    comm_seconds: float
    fits: bool
    global_batch: int = 1

    @property
    def label(self) -> str:
        extra = "x".join(o.split("=", 1)[1] for o in self.overrides if o.startswith(("strategy.tp=", "strategy.pp=")))
        if self.strategy == "expert_parallel":  # e.g. "expert_parallel (ep8, fsdp)"
            extra = ", ".join([f"ep{o.split('=', 1)[1]}" for o in self.overrides if o.startswith("strategy.ep=")] + [
                o.split("=", 1)[1] for o in self.overrides if o.startswith("strategy.data_parallel=")])
        return self.strategy + (" tiled" if any("tiling" in o for o in self.overrides) else "") + (
            " 8-bit" if "model.optimizer=adamw8bit" in self.overrides else "") + (f" ({extra})" if extra else "")


@dataclass
class Advice:
    strategy: str | None
    overrides: list[str]
    reasons: list[str]
    per_device_bytes: int
    candidates: list[Candidate] = field(default_factory=list)
    model_overrides: list[str] = field(default_factory=list)
    precision: str = "bf16-mixed"

    def command(self) -> str:
        """The complete command: strategy, model, data and trainer overrides."""
        if self.strategy is None:
            return ""
        return " ".join(["python run.py", f"strategy={self.strategy}", *self.model_overrides,
                         f"trainer.precision={self.precision}", *self.overrides])

    def table(self, budget: float) -> str:
        head = (f"{'candidate':<34}{'peak GiB':>10}{'acts':>8}{'transient':>10}{'fits':>6}"
                f"{'comm GB/step':>14}{'comm s/step':>13}")
        lines = [head, "-" * len(head)]
        for c in self.candidates:
            m = c.memory
            lines.append(f"{c.label:<34}{m.peak / GIB:>10.2f}{m.activations / GIB:>8.2f}{m.transient / GIB:>10.2f}"
                         f"{'yes' if c.fits else 'NO':>6}{c.comm_bytes / 1e9:>14.2f}{c.comm_seconds:>13.3f}")
        return "\n".join(lines + [f"(fits: peak <= {budget / GIB:.1f} GiB usable)"])


def model_overrides(shape: Shape, preset: str | None, global_batch: int) -> list[str]:
    """Overrides that build exactly ``shape`` and feed it ``global_batch`` sequences per step."""
    if preset:
        out = [f"model={preset}"]
    else:
        out = ["model=gpt_small", "model.preset=null", f"+model.n_layer={shape.n_layer}",
               f"+model.n_embd={shape.n_embd}", f"+model.n_head={shape.n_head}",
               f"+model.vocab_size={shape.vocab_size}", f"+model.block_size={shape.block_size or shape.seq_len}",
               f"+model.mlp_ratio={shape.mlp_ratio}", f"+model.bias={str(shape.bias).lower()}"]
    return out + [f"data.seq_len={shape.seq_len}", f"data.global_batch_size={global_batch}"]


def _axis_bandwidth(mesh: dict[str, int], cluster: Cluster) -> dict[str, float]:
    """GB/s of each mesh axis: within a node when the axis and the axes inside it fit in one node."""
    out, inner = {}, 1
    for axis in ("tp", "ep", "dp_shard", "dp_replicate", "pp"):  # innermost first (parallel/mesh.py)
        inner *= mesh.get(axis, 1)
        out[axis] = cluster.intra_node_gbs if inner <= cluster.devices_per_node else cluster.inter_node_gbs
    out["world"] = cluster.intra_node_gbs if inner <= cluster.devices_per_node else cluster.inter_node_gbs
    return out


def _candidate(strategy: str, shape: Shape, cluster: Cluster, budget: float, micro: int, kw: dict,
               overrides: list[str], **lay) -> Candidate | None:
    n = 1 if strategy == "single" else cluster.devices
    try:
        lo = layout(strategy, n, **lay)
    except ValueError:
        return None
    mesh = lo.mesh
    dp = mesh.get("dp_replicate", 1) * mesh.get("dp_shard", 1) * mesh.get("ep", 1)  # ep is a data axis too
    per_rank = micro * (lo.n_microbatches or lo.pp)  # a pipeline splits its batch into micro-batches of ``micro``
    try:
        mem = estimate(shape, devices=n, strategy=strategy, micro_batch_size=per_rank, layout_=lo, **kw)
    except ValueError:  # a layout the estimator does not price (tensor parallelism of an MoE model)
        return None
    u = shape.units()
    cshape = comm_model.CommShape(shape.n_layer, shape.n_embd, shape.seq_len, micro,
                                  shape.vocab_size, shape.mlp_ratio, shape.block_size, shape.bias,
                                  shape.n_moe_layers, shape.n_experts, shape.top_k)
    experts = shape.n_moe_layers * u.get("moe_experts", 0)
    # gradients and gathered parameters travel in the parameters' dtype (fp32 under autocast's bf16-mixed)
    dtype = int(bytes_per_param(kw["precision"], kw["optimizer"])[1])
    try:
        comm = comm_model.step_comm_bytes(strategy, n_params=u["total"], mesh=mesh, dtype_bytes=dtype, shape=cshape,
                                          micro_batches=lo.n_microbatches or lo.pp, schedule=lo.schedule,
                                          expert_params=experts,
                                          data_parallel=lo.data_parallel,
                                          activation_bytes=dtypes(kw["precision"])[0],  # the experts' compute dtype
                                          recompute=bool(kw["checkpointing"]))
    except ValueError:
        comm = {}
    seconds = comm_model.predicted_seconds(comm, {**mesh, "world": n}, _axis_bandwidth(mesh, cluster))
    nodes = [f"trainer.devices={min(n, cluster.devices_per_node)}"] + (
        [f"trainer.num_nodes={cluster.nodes}"] if n > cluster.devices_per_node else [])
    return Candidate(strategy, nodes + overrides, mem, comm_model.total_bytes(comm), seconds, mem.peak <= budget,
                     per_rank * dp)


def advise(shape: Shape, cluster: Cluster, *, precision: str = "bf16-mixed", optimizer: str = "adamw",
           micro_batch_size: int = 1, checkpointing: bool = True, headroom: float = 0.9,
           preset: str | None = None) -> Advice:
    budget = cluster.device_memory_gb * GIB * headroom
    kw = dict(precision=precision, optimizer=optimizer, checkpointing=checkpointing, device="cuda")
    ckpt = ["strategy.activation_checkpointing=true"] if checkpointing else []
    gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    dpn, nodes, n = cluster.devices_per_node, cluster.nodes, cluster.devices
    fleet = Fleet(n, dpn, nodes, shape.n_experts if shape.n_moe_layers else 0, optimizer)
    order = []
    for e in sorted((e for e in CATALOG if e.advise), key=lambda e: e.preference):
        for o in e.advise(fleet):
            okw = {**kw, "optimizer": o.optimizer} if o.optimizer else kw
            order.append(_candidate(e.name, shape, cluster, budget, micro_batch_size, okw, [*o.overrides, *ckpt],
                                    **o.layout))
    moe = shape.n_moe_layers > 0
    c = lambda s, o=(), **lay: _candidate(s, shape, cluster, budget, micro_batch_size, kw, [*o, *ckpt], **lay)  # noqa: E731
    cands = [x for x in order if x is not None]
    reasons: list[str] = []
    whole = c("single")
    if whole.fits:
        reasons.append(f"the whole step ({gib(whole.memory.peak)} at its peak) fits one device ({gib(budget)} usable)")
    else:
        reasons.append(f"the whole step needs {gib(whole.memory.peak)} at its peak ({whole.memory.moment}): "
                       f"more than one device ({gib(budget)} usable)")
    fitting = [x for x in cands if x.fits]
    slow = nodes > 1 and cluster.inter_node_gbs < cluster.intra_node_gbs / 4
    if not fitting:
        tiled = _tiled_offload(shape, cluster, budget, micro_batch_size, kw, ckpt, reasons)
        if tiled is not None:
            cands.append(tiled)
            fitting = [tiled]
    if not fitting:
        reasons.append("no candidate's predicted peak fits: add devices, lower the micro-batch or the sequence")
        return Advice(None, [], reasons, 0, cands, model_overrides(shape, preset, micro_batch_size), precision)
    if moe and len(fitting) > 1 and fitting[0].strategy not in ("single", "ddp"):
        best = min(fitting, key=lambda x: x.comm_seconds)
        reasons.append(_moe_reason(best, fitting, cands))
    elif slow and len(fitting) > 1:
        best = min(fitting, key=lambda x: x.comm_seconds)
        reasons.append(f"links between nodes are slow ({cluster.inter_node_gbs:g} GB/s): of the plans that fit, "
                       f"{best.label} spends the least time communicating ({best.comm_seconds:.3f} s per step)")
    else:
        best = fitting[0]
        if moe and best.strategy == "ddp":
            reasons.append("MoE model that fits every device: replicate the experts (ddp); its gradient all-reduce "
                           "overlaps backward, while expert parallelism's all-to-all of the tokens sits on the "
                           "critical path of every MoE layer")
        elif best.strategy not in ("single", "ddp", "zero3_offload"):
            reasons.append(f"{best.label} is the least sharding that fits ({gib(best.memory.peak)} per device at its "
                           "peak): each further stage adds communication")
        elif "model.optimizer=adamw8bit" in best.overrides:
            reasons.append(f"with 8-bit AdamW states (torchao AdamW8bit) the step fits one device "
                           f"({gib(best.memory.peak)} at its peak): no sharding or offload needed")
        elif best.strategy == "zero3_offload" and not any("tiling" in o for o in best.overrides):
            reasons.append(f"only ZeRO-3 with the states in host memory fits ({gib(best.memory.peak)} on the device)")
    return Advice(best.strategy, best.overrides, reasons, best.memory.peak, cands,
                  model_overrides(shape, preset, best.global_batch), precision)


def _moe_reason(best: Candidate, fitting: list[Candidate], cands: list[Candidate]) -> str:
    """Why this plan for an MoE model: expert parallelism trades the experts' gradient all-reduce
    (replication) or their all-gathers (FSDP) for an all-to-all of the routed tokens."""
    gib = best.memory.peak / GIB
    others = [x for x in fitting if x is not best]
    alt = min(others, key=lambda x: x.comm_seconds)
    what = ("spreads the experts over ranks and moves tokens to them (all-to-all) instead of replicating or "
            "gathering expert weights" if best.strategy == "expert_parallel" else
            "replicates or shards the experts like every other weight: at this size that costs less than "
            "an all-to-all of the routed tokens")
    return (f"MoE model: of the plans that fit, {best.label} {what}; it communicates {best.comm_bytes / 1e9:.2f} GB "
            f"per step ({best.comm_seconds:.3f} s) against {alt.comm_bytes / 1e9:.2f} GB ({alt.comm_seconds:.3f} s) "
            f"for {alt.label}, at a peak of {gib:.1f} GiB per device")


def _tiled_offload(shape: Shape, cluster: Cluster, budget: float, micro: int, kw: dict, ckpt: list[str],
                   reasons: list[str]) -> Candidate | None:
    """ZeRO-3 + CPU offload with the largest linears tiled, the fewest tiles that fit (ZeRO-Infinity)."""
    u = shape.units()
    linears = sorted((k.split(".", 1)[1] for k in u if k.startswith("block.")), key=lambda k: -u[f"block.{k}"])
    big = [name for name in linears if u[f"block.{name}"] >= 0.25 * u["block"]]  # the MLP matrices
    out_features = {name: (shape.mlp_ratio * shape.n_embd if name == "mlp.fc" else shape.n_embd) for name in big}
    for k in TILES:
        if any(out_features[name] % k for name in big) or shape.vocab_size % k:
            continue
        tiling = {f"net.blocks.{i}.{name}": k for i in range(shape.n_layer) for name in big}
        tiling["net.head.lm_head"] = k
        text = "{" + ",".join(f"{p}:{t}" for p, t in tiling.items()) + "}"
        cand = _candidate("zero3_offload", shape, cluster, budget, micro, kw, [f"+strategy.tiling={text}", *ckpt],
                          tiling=tiling)
        if cand is not None and cand.fits:
            reasons.append(f"even ZeRO-3 with offload must all-gather a whole layer; tiling the MLP linears and the "
                           f"output head into {k} tiles (each its own FSDP unit) brings the peak to "
                           f"{cand.memory.peak / GIB:.1f} GiB")
            return cand
    if u["embed_table"] * 4 > budget:
        reasons.append("the embedding table alone exceeds a device and cannot be tiled: tensor parallelism "
                       "(vocabulary-parallel embedding) within a node is needed")
    return None
