"""``python -m lightning_par.modes.advise``: the strategy advisor (``lightning_par/advisor.py``) on a
command line: the model (a preset -- our GPT / MoE or a Hugging Face decoder of conf/model -- or a
parameter count with its layers and width) and the cluster in, the recommended plan, the reasons,
every candidate's cost and the command that runs it out."""

from __future__ import annotations

import argparse
import sys

from lightning_par.advisor import Advice, Cluster, advise
from lightning_par.costs.activations import Shape
from lightning_par.estimate import GIB, preset_names


def shape_from_args(args: argparse.Namespace) -> tuple[Shape, str | None]:
    from lightning_par.estimate import model_shape

    if args.model:
        return model_shape(args.model, args.seq_len)[1], args.model
    if not (args.layers and args.hidden):
        raise ValueError("--params needs --layers and --hidden")
    heads = args.heads or max(1, args.hidden // 128)
    shape = Shape(args.layers, args.hidden, heads, args.vocab, args.seq_len or 2048, args.mlp_ratio,
                  bias=False, block_size=args.seq_len or 2048)
    got = shape.units()["total"]
    if abs(got - args.params) > 0.1 * args.params:
        raise ValueError(f"--layers {args.layers} --hidden {args.hidden} --vocab {args.vocab} build {got:,} "
                         f"parameters, not about {args.params:,.0f}")
    return shape, None


def _precision(text: str) -> str:
    """Lightning's spellings (``bf16`` -> ``bf16-mixed``), checked against the estimator's table."""
    from lightning_par.costs.states import PRECISIONS
    from lightning_par.dtypes import canonical_precision

    name = canonical_precision(text)
    if name not in PRECISIONS:
        raise argparse.ArgumentTypeError(f"{text!r}: choose one of {', '.join(PRECISIONS)}")
    return name


def main(argv: list[str] | None = None) -> Advice:
    ap = argparse.ArgumentParser(prog="python -m lightning_par.modes.advise",
                                 description="Strategy advisor: which strategy for this model on this cluster, "
                                             "and the command that runs it.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="PRESET",
                     help="a model of conf/model: " + ", ".join(preset_names()) + " (the GPT and MoE presets, "
                          "then the Hugging Face decoders)")
    src.add_argument("--params", type=float, help="parameter count, e.g. 70e9 (with --layers and --hidden)")
    ap.add_argument("--layers", type=int, help="decoder layers (with --params)")
    ap.add_argument("--hidden", type=int, help="hidden size (with --params)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads; default: hidden / 128")
    ap.add_argument("--vocab", type=int, default=50304, help="vocabulary size (default: %(default)s)")
    ap.add_argument("--mlp-ratio", type=int, default=4, help="MLP inner size / hidden (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="tokens per sequence; default: the preset's block_size (a Hugging Face one's "
                         "max_positions), else 2048")
    ap.add_argument("--nodes", type=int, default=1, help="nodes (default: %(default)s)")
    ap.add_argument("--devices-per-node", type=int, default=8, help="GPUs per node (default: %(default)s)")
    ap.add_argument("--device-memory", type=float, default=80.0, help="GiB per device (default: %(default)s)")
    ap.add_argument("--intra-node-gbs", type=float, default=300.0,
                    help="GB/s per device within a node (default: %(default)s, NVLink-class)")
    ap.add_argument("--inter-node-gbs", type=float, default=25.0,
                    help="GB/s per device between nodes (default: %(default)s, InfiniBand-class)")
    ap.add_argument("--precision", default="bf16-mixed", type=_precision,
                    help="trainer.precision, Lightning's spellings (bf16, bf16-mixed, 32, 32-true, ...; "
                         "default: %(default)s)")
    ap.add_argument("--micro-batch-size", type=int, default=1, help="sequences per rank per micro-batch "
                                                                    "(default: %(default)s)")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="sequences per optimizer step (default: the micro-batch size x every device); every plan "
                         "is priced at it, with accumulation or pipeline micro-batches to reach it")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="dense bf16 TFLOP/s per device, for step time and MFU (default: %(default)s, H100 SXM)")
    ap.add_argument("--efficiency", type=float, default=0.5,
                    help="fraction of the peak a step's matmuls reach (default: %(default)s)")
    ap.add_argument("--host-memory", type=float, default=None,
                    help="GiB of host memory per node; offload plans must fit it (default: not checked, shown)")
    ap.add_argument("--nvme", type=float, default=None,
                    help="GiB of local disk (NVMe) per node for the disk tier of offload (zero3_offload "
                         "strategy.offload_dir); tried when CPU offload does not fit --host-memory (default: none)")
    ap.add_argument("--nvme-gbs", type=float, default=3.0,
                    help="GB/s the node's NVMe reads and writes, shared by its ranks: the disk tier's step time "
                         "(default: %(default)s)")
    ap.add_argument("--host-link-gbs", type=float, default=25.0,
                    help="GB/s between a device and the host, for offload (default: %(default)s)")
    ap.add_argument("--no-checkpointing", action="store_true", help="assume no activation checkpointing")
    args = ap.parse_args(argv)
    try:
        shape, preset = shape_from_args(args)
        for name in ("nodes", "devices_per_node", "device_memory", "intra_node_gbs", "inter_node_gbs",
                     "micro_batch_size", "global_batch", "peak_tflops", "host_memory", "host_link_gbs", "nvme",
                     "nvme_gbs"):
            value = getattr(args, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if not 0 < args.efficiency <= 1:
            raise ValueError(f"--efficiency must be in (0, 1], got {args.efficiency}")
        cluster = Cluster(args.nodes, args.devices_per_node, args.device_memory, args.intra_node_gbs,
                          args.inter_node_gbs, args.peak_tflops, args.efficiency, args.host_link_gbs, args.host_memory,
                          args.nvme, args.nvme_gbs)
        advice = advise(shape, cluster, precision=args.precision, micro_batch_size=args.micro_batch_size,
                        checkpointing=not args.no_checkpointing, preset=preset, global_batch=args.global_batch)
    except ValueError as exc:
        ap.error(str(exc))
    budget = cluster.device_memory_gb * GIB * 0.9
    print(f"Recommended: {advice.strategy or 'nothing fits'}")
    for r in advice.reasons:
        print(f"  - {r}")
    print()
    print(advice.table(budget))
    print()
    if advice.strategy is None:
        sys.exit(2)
    print("Run it with:")
    print("  " + advice.command())
    return advice


if __name__ == "__main__":
    main()
