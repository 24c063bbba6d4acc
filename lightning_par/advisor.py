"""Strategy advisor: which strategy for this model on this cluster, and the command to run it.

The decision tree of the field's standard notes, with every "fits" decided by the memory model of
``lightning_par.estimate`` (model states by the ZeRO paper's formulas, activations by Korthikanti
et al.; a device counts as fitting when the estimate is within ``headroom`` of its memory):

1. The whole training state fits one device -> ``single`` on one device, else ``ddp`` (cheapest
   communication: one gradient all-reduce, overlapped with backward).
2. Not, and even the largest layer (its weights and gradients at working precision) does not fit
   one device -> tensor parallelism within a node is unavoidable (``tensor_parallel`` /
   ``fsdp_tp``; ``3d`` when pipeline stages across nodes are needed too).
3. Not, layers fit: shard data-parallel states, least sharding that fits (each stage adds
   communication): ``zero1`` -> ``zero2`` -> ``fsdp`` (ZeRO-3).
   On several nodes with slow links between them, a full shard over every rank all-gathers across
   nodes every layer; prefer ``hsdp`` (shard within a node, replicate across) when a node's worth
   of sharding fits, else cut the model: TP within nodes and pipeline stages across nodes (``3d``),
   which sends only activations between nodes.
4. One device that cannot hold it at all -> ``zero3_offload`` (states in host memory).

TP and PP memory (not in the ZeRO paper's model): model states divide by tp x pp (each rank
holds 1/tp of every layer of 1/pp of the layers), activations by tp (sequence parallelism shards
the rest) and, for 1F1B, the first stage keeps pp micro-batches of its L/pp layers -- one full
micro-batch's worth, so activations per rank are A / tp.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from lightning_par.estimate import GIB, Shape, activation_bytes, bytes_per_param, estimate, estimate_table


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    devices_per_node: int = 8
    device_memory_gb: float = 80.0  # GiB per device
    slow_inter_node: bool = False  # e.g. Ethernet between nodes, NVLink/InfiniBand-class within

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass
class Advice:
    strategy: str
    overrides: list[str]
    reasons: list[str]
    per_device_bytes: int
    table: str
    mesh: dict[str, int] = field(default_factory=dict)

    def command(self, model: str | None) -> str:
        parts = ["python run.py", f"strategy={self.strategy}"]
        if model:
            parts.append(f"model={model}")
        return " ".join(parts + self.overrides)


def largest_layer_params(shape: Shape, mlp_ratio: int = 4) -> int:
    """Parameters of the biggest single weight: the vocabulary table/head or an MLP matrix."""
    return max(shape.vocab_size * shape.n_embd, mlp_ratio * shape.n_embd * shape.n_embd)


def advise(n_params: int, shape: Shape, cluster: Cluster, *, precision: str = "bf16-mixed", optimizer: str = "adamw",
           micro_batch_size: int = 1, checkpointing: bool = True, headroom: float = 0.9) -> Advice:
    budget = cluster.device_memory_gb * GIB * headroom
    kw = dict(precision=precision, optimizer=optimizer, shape=shape, micro_batch_size=micro_batch_size,
              checkpointing=checkpointing)
    n = cluster.devices
    table = estimate_table(n_params, devices=n, device_memory=cluster.device_memory_gb * headroom, **kw)
    p, g, k = bytes_per_param(precision, optimizer)
    gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    reasons: list[str] = []
    nodes = ["trainer.devices=" + str(cluster.devices_per_node)] + (
        [f"trainer.num_nodes={cluster.nodes}"] if cluster.nodes > 1 else [])
    act_flag = ["strategy.activation_checkpointing=true"] if checkpointing else []

    whole = estimate(n_params, devices=1, strategy="single", **kw)
    if whole.total <= budget:
        reasons.append(f"the whole training state ({gib(whole.total)}) fits one device ({gib(budget)} usable)")
        if n == 1:
            return Advice("single", [], reasons, whole.total, table)
        reasons.append("so plain data parallelism: replicas plus one overlapped gradient all-reduce")
        return Advice("ddp", nodes, reasons, whole.total, table, {"dp_replicate": n})
    reasons.append(f"the training state ({gib(whole.total)}) does not fit one device ({gib(budget)} usable)")

    layer = largest_layer_params(shape) * (p + g)
    if layer > budget:
        tp = cluster.devices_per_node
        pp = cluster.nodes
        per = _model_parallel_bytes(n_params, shape, tp, pp, p + g + k, kw)
        reasons.append(f"its largest layer alone ({gib(layer)} of weights and grads) exceeds a device: "
                       f"split every layer with tensor parallelism within a node (tp={tp})")
        if pp > 1:
            reasons.append(f"and cut pipeline stages across the {pp} nodes (pp={pp}): {gib(per)} per device")
            return Advice("3d", nodes + [f"strategy.tp={tp}", f"strategy.pp={pp}"] + act_flag, reasons, per,
                          table, {"pp": pp, "tp": tp})
        if per > budget:
            reasons.append(f"even so {gib(per)} per device does not fit: add nodes (pipeline stages) or devices")
        else:
            reasons.append(f"{gib(per)} per device")
        return Advice("tensor_parallel", nodes + act_flag, reasons, per, table, {"tp": tp})

    if n == 1:
        off = estimate(n_params, devices=1, strategy="zero3_offload", **kw)
        reasons.append(f"one device: keep parameters, gradients and optimizer state in host memory "
                       f"({gib(off.offloaded)} on the host, {gib(off.total)} of activations on the device)")
        return Advice("zero3_offload", act_flag, reasons, off.total, table)

    multi_slow = cluster.nodes > 1 and cluster.slow_inter_node
    for strategy in ("zero1", "zero2", "fsdp"):
        est = estimate(n_params, devices=n, strategy=strategy, **kw)
        if est.total <= budget and not (multi_slow and strategy == "fsdp"):
            if multi_slow:  # zero1/zero2 only all-reduce/reduce-scatter gradients once per step across nodes
                reasons.append("links between nodes are slow, but this stage communicates gradients only once "
                               "per step")
            reasons.append(f"{strategy} over all {n} ranks fits: {gib(est.total)} per device "
                           "(the least sharding that fits, so the least communication)")
            return Advice(strategy, nodes + act_flag, reasons, est.total, table, {"dp_shard": n})

    if multi_slow:
        node_shard = estimate(n_params, devices=cluster.devices_per_node, strategy="fsdp", **kw)
        if node_shard.total <= budget:
            reasons.append(f"slow links between nodes: shard within each node and replicate across nodes (hsdp): "
                           f"{gib(node_shard.total)} per device")
            return Advice("hsdp", nodes + [f"strategy.replicate={cluster.nodes}"] + act_flag, reasons,
                          node_shard.total, table, {"dp_replicate": cluster.nodes,
                                                     "dp_shard": cluster.devices_per_node})
        tp, pp = cluster.devices_per_node, cluster.nodes
        per = _model_parallel_bytes(n_params, shape, tp, pp, p + g + k, kw)
        reasons.append(f"one node's worth of sharding ({gib(node_shard.total)} per device) does not fit and "
                       "links between nodes are slow: tensor parallelism within nodes, pipeline stages across "
                       f"nodes (only activations cross nodes): tp={tp} x pp={pp}, {gib(per)} per device")
        return Advice("3d", nodes + [f"strategy.tp={tp}", f"strategy.pp={pp}"] + act_flag, reasons, per, table,
                      {"pp": pp, "tp": tp})

    est = estimate(n_params, devices=n, strategy="fsdp", **kw)
    if est.total <= budget:
        reasons.append(f"fsdp (ZeRO-3) over all {n} ranks fits: {gib(est.total)} per device")
        return Advice("fsdp", nodes + act_flag, reasons, est.total, table, {"dp_shard": n})
    off = estimate(n_params, devices=n, strategy="zero3_offload", **kw)
    reasons.append(f"even ZeRO-3 over {n} ranks needs {gib(est.total)} per device: offload states to host memory")
    return Advice("zero3_offload", nodes + act_flag, reasons, off.total, table)


def _model_parallel_bytes(n_params: int, shape: Shape, tp: int, pp: int, state_bytes: int, kw: dict) -> int:
    states = -(-n_params // (tp * pp)) * state_bytes
    return states + activation_bytes(shape, micro_batch_size=kw["micro_batch_size"], precision=kw["precision"],
                                     checkpointing=kw["checkpointing"]) // tp


def main(argv: list[str] | None = None) -> Advice:
    ap = argparse.ArgumentParser(prog="python -m lightning_par.advisor", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a GPT preset name (see conf/model)")
    src.add_argument("--params", type=float, help="parameter count (then give --layers and --hidden)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int, default=None, help="default: hidden / 128")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--devices-per-node", type=int, default=8)
    ap.add_argument("--device-memory", type=float, default=80.0, help="GiB per device")
    ap.add_argument("--slow-inter-node", action="store_true", help="slow links between nodes (e.g. Ethernet)")
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--no-checkpointing", action="store_true", help="assume no activation checkpointing")
    args = ap.parse_args(argv)
    try:
        if args.model:
            from lightning_par.estimate import model_shape

            n_params, shape = model_shape(args.model, args.seq_len)
        else:
            if not (args.layers and args.hidden):
                raise ValueError("--params needs --layers and --hidden")
            heads = args.heads or max(1, args.hidden // 128)
            n_params, shape = int(args.params), Shape(args.layers, args.hidden, heads, args.vocab, args.seq_len)
        cluster = Cluster(args.nodes, args.devices_per_node, args.device_memory, args.slow_inter_node)
        advice = advise(n_params, shape, cluster, precision=args.precision, micro_batch_size=args.micro_batch_size,
                        checkpointing=not args.no_checkpointing)
    except ValueError as exc:
        ap.error(str(exc))
    print(f"Recommended: {advice.strategy}")
    for r in advice.reasons:
        print(f"  - {r}")
    print()
    print(advice.table)
    print()
    print("Run it with:")
    print("  " + advice.command(args.model))
    return advice


if __name__ == "__main__":
    main()
