"""``lightning-par-advise`` (``python -m lightning_par.modes.advise``): the strategy advisor
(``lightning_par/costs/advisor.py``) on a command line. The model in -- a preset (our GPT / MoE or a Hugging
Face decoder of conf/model), a transformers config (``--config config.json``), a ``save_pretrained``
directory (``--pretrained DIR``: its config.json only, no weight is read), or a parameter count with
its sizes (a GPT, or with ``--kv-heads`` / ``--intermediate`` / ``--tie-embeddings`` / ``--arch`` a
Llama-style decoder built from its transformers config) -- and the cluster in; out: the recommended
plan (the chosen row by name), the model priced (its parameter count, from the model itself, and
shape), the margin to the memory limit, the reasons, every candidate's cost, the command that runs it
and the extras that command needs."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_par.costs.advisor import LORA_RANK, Advice, Cluster, advise, describe
from lightning_par.costs.calibration import calibrate
from lightning_par.costs.measured import DEFAULT_GPU, GPUS, measured_efficiency
from lightning_par.costs.shape import Shape
from lightning_par.costs.estimate import preset_names

#: the longest default sequence for a config (``--seq-len`` unset): its max_position_embeddings, at most this
MAX_DEFAULT_SEQ = 8192
#: a flags-built model further than this from ``--params`` gets a line saying so
PARAMS_NOTE = 0.02
#: the flags only the Llama-style form takes (``--arch llama`` / ``qwen2``), by their argparse dest
_LLAMA_FLAGS = ("kv_heads", "intermediate", "tie_embeddings")
#: every flag that sizes a model (only with ``--params``)
_SIZE_FLAGS = ("layers", "hidden", "heads", "vocab", "mlp_ratio", "arch", *_LLAMA_FLAGS)


@dataclass(frozen=True)
class Asked:
    """The model of the question: its shape, how the command names it, where it came from."""

    shape: Shape
    preset: str | None = None
    pretrained: str | None = None  # a save_pretrained directory (absolute)
    source: str = ""  # what the user gave, for the output
    params: float | None = None  # --params, to compare with the count priced


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def read_hf_config(path: str, *, directory: bool) -> Any:
    """The transformers config of ``path``: a ``config.json`` (or a directory holding one), or with
    ``directory`` a ``save_pretrained`` directory (``models/hf/pretrained.py``'s reader: a causal LM's
    config, dropout off). Never reads weights. ValueError (one line) where it cannot."""
    from lightning_par.models.hf.pretrained import _transformers, pretrained_config

    p = Path(path).expanduser()
    if directory or p.is_dir():
        return pretrained_config(p)  # WeightsError is a ValueError, naming the path
    if not p.is_file():
        raise ValueError(f"--config {path}: no such file")
    transformers = _transformers()
    try:
        cfg = transformers.AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers' validators raise their own types
        why = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"--config {path} cannot be read as a transformers config ({why[:300]})") from None
    if type(cfg) not in transformers.AutoModelForCausalLM._model_mapping:
        raise ValueError(f"--config {path}: a {cfg.model_type!r} config, not a causal language model's")
    return cfg


def _hf_count(cfg: Any) -> int:
    """Parameters of the model of ``cfg``, built by transformers on the meta device."""
    import torch

    from lightning_par.models.hf.pretrained import _transformers

    with torch.device("meta"):
        net = _transformers().AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in net.parameters())


def shape_of_config(cfg: Any, seq_len: int | None, what: str) -> Shape:
    """The ``Shape`` of a transformers config at ``seq_len`` (default: its longest sequence, at most
    ``MAX_DEFAULT_SEQ``). ValueError naming the model and its parameter count where the cost model
    has no shape for its architecture (an MoE family, sliding-window layers, ...)."""
    from lightning_par.models.hf.causal_lm import _max_positions

    positions = _max_positions(cfg)
    seq = seq_len or min(positions or MAX_DEFAULT_SEQ, MAX_DEFAULT_SEQ)
    if positions is not None and seq > positions:
        raise ValueError(f"--seq-len {seq}: {what} takes at most {positions} positions")
    try:
        return Shape.of_hf(cfg, seq)
    except ValueError as e:
        experts = next((int(v) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                        if isinstance(v := getattr(cfg, k, None), int) and v > 1), 0)
        moe = f", {experts} experts" if experts else ""
        raise ValueError(f"{what}: a {cfg.model_type} model ({_hf_count(cfg):,} parameters{moe}) that the advisor "
                         f"cannot price: {e}") from None


def shape_from_args(args: argparse.Namespace) -> Asked:
    """The model the arguments ask about (``Asked``); ValueError (one line) for a contradiction."""
    from lightning_par.costs.estimate import model_shape

    given = [_flag(d) for d in _SIZE_FLAGS if getattr(args, d) not in (None, False)]
    if args.params is None and given:
        raise ValueError(f"{', '.join(given)}: only with --params (the model of --model / --config / --pretrained "
                         "has its own sizes)")
    if args.model:
        return Asked(model_shape(args.model, args.seq_len)[1], preset=args.model, source=f"model={args.model}")
    if args.config or args.pretrained:
        path = args.config or args.pretrained
        what = f"{'--config' if args.config else '--pretrained'} {path}"
        shape = shape_of_config(read_hf_config(path, directory=bool(args.pretrained)), args.seq_len, what)
        pretrained = str(Path(path).expanduser().resolve()) if args.pretrained else None
        return Asked(shape, pretrained=pretrained, source=what)
    if not (args.layers and args.hidden):
        raise ValueError("--params needs --layers and --hidden")
    seq = args.seq_len or 2048
    heads = args.heads or max(1, args.hidden // 128)
    vocab = args.vocab or 50304
    llama = [_flag(d) for d in _LLAMA_FLAGS if getattr(args, d) not in (None, False)]
    ratio = args.mlp_ratio
    arch = args.arch or ("llama" if llama or (ratio is not None and not float(ratio).is_integer()) else "gpt")
    if arch == "gpt":
        if llama:
            raise ValueError(f"{', '.join(llama)}: not a GPT's (full multi-head attention, MLP = mlp_ratio x "
                             "hidden, untied head); use --arch llama")
        if ratio is not None and not float(ratio).is_integer():
            raise ValueError(f"--mlp-ratio {ratio:g}: our GPT's MLP is an integer ratio x hidden; a gated MLP of "
                             "that size: --arch llama")
        shape = Shape(args.layers, args.hidden, heads, vocab, seq, int(ratio or 4), bias=False, block_size=seq)
    else:
        from lightning_par.models.hf.causal_lm import hf_config

        if args.intermediate and ratio is not None:
            raise ValueError("--intermediate and --mlp-ratio both say the MLP's size: give one")
        inner = args.intermediate or (ratio or 4) * args.hidden
        if inner != int(inner):
            raise ValueError(f"--mlp-ratio {ratio:g} x --hidden {args.hidden} = {inner:g} is not a whole size; "
                             "give --intermediate")
        shape = Shape.of_hf(hf_config(arch, hidden=args.hidden, layers=args.layers, heads=heads,
                                      kv_heads=args.kv_heads, intermediate=int(inner), vocab=vocab,
                                      max_positions=seq, tie_word_embeddings=bool(args.tie_embeddings)), seq)
    got = shape.units()["total"]
    if abs(got - args.params) > 0.1 * args.params:
        raise ValueError(f"--layers {args.layers} --hidden {args.hidden} --vocab {vocab} build {got:,} "
                         f"parameters ({arch}), not about {args.params:,.0f}")
    return Asked(shape, source=f"--params {args.params / 1e9:g}e9 ({arch}, from the flags)", params=args.params)


def model_lines(asked: Asked) -> list[str]:
    """What was priced (``advisor.describe``) and, for a parameter count, how far the model is from it."""
    count, arch, *more = describe(asked.shape)
    lines = [f"Model: {count}, from {asked.source}", f"  {arch}", *(f"  {m}" for m in more)]
    if asked.params:
        got = asked.shape.units()["total"]
        off = got / asked.params - 1
        lines[0] += f" ({off:+.1%} from --params)"
        if abs(off) > PARAMS_NOTE and not asked.shape.hf:
            lines.append(f"  note: these flags build a GPT of {got:,} parameters, {abs(off):.1%} "
                         f"{'below' if off < 0 else 'above'} --params; for a Llama-style model give its "
                         "--kv-heads, --intermediate (or a --mlp-ratio such as 3.5), --tie-embeddings, or "
                         "--config its config.json")
    return lines


def _precision(text: str) -> str:
    """Lightning's spellings (``bf16`` -> ``bf16-mixed``), checked against the estimator's table."""
    from lightning_par.costs.states import PRECISIONS
    from lightning_par.core.dtypes import canonical_precision

    name = canonical_precision(text)
    if name not in PRECISIONS:
        raise argparse.ArgumentTypeError(f"{text!r}: choose one of {', '.join(PRECISIONS)}")
    return name


def main(argv: list[str] | None = None, prog: str = "python -m lightning_par.modes.advise") -> Advice:
    ap = argparse.ArgumentParser(prog=prog,
                                 description="Strategy advisor: which strategy for this model on this cluster, "
                                             "and the command that runs it.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="PRESET",
                     help="a model of conf/model: " + ", ".join(preset_names()) + " (the GPT and MoE presets, "
                          "then the Hugging Face decoders)")
    src.add_argument("--config", metavar="PATH",
                     help="a transformers config.json (or a directory holding one): the model it describes, "
                          "priced from transformers' own model of it (llama, qwen2 and gpt2 families); the "
                          "command trains it from scratch (model=hf_causal_lm and its sizes)")
    src.add_argument("--pretrained", metavar="DIR",
                     help="a save_pretrained directory: its config.json, as --config (no weight is read); the "
                          "command fine-tunes it (model.pretrained=DIR)")
    src.add_argument("--params", type=float, help="parameter count, e.g. 70e9 (with --layers and --hidden): a GPT, "
                     "or with --kv-heads / --intermediate / --tie-embeddings / --arch llama a Llama-style decoder")
    ap.add_argument("--layers", type=int, help="decoder layers (with --params)")
    ap.add_argument("--hidden", type=int, help="hidden size (with --params)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (with --params; default: hidden / 128)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (with --params; default: 50304)")
    ap.add_argument("--mlp-ratio", type=float, default=None,
                    help="MLP inner size / hidden (with --params; default 4): a GPT's an integer; a fraction "
                         "(SwiGLU's 3.5) builds a Llama-style gated MLP of ratio x hidden")
    ap.add_argument("--arch", choices=("gpt", "llama", "qwen2"), default=None,
                    help="with --params: our GPT (full multi-head attention, GELU MLP, untied head, learned "
                         "positions) or a transformers Llama / Qwen2 (grouped-query attention, gated MLP, RMSNorm, "
                         "rotary positions); default: llama where --kv-heads, --intermediate, --tie-embeddings or "
                         "a fractional --mlp-ratio is given, else gpt")
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="key/value heads of grouped-query attention (with --params; default: the heads)")
    ap.add_argument("--intermediate", type=int, default=None,
                    help="the gated MLP's inner size (with --params), e.g. 14336 for Llama-3-8B")
    ap.add_argument("--tie-embeddings", action="store_true", default=None,
                    help="the output head shares the token embedding's table (with --params)")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="tokens per sequence; default: the preset's block_size (a Hugging Face one's "
                         f"max_positions), a config's max_position_embeddings up to {MAX_DEFAULT_SEQ}, else 2048")
    ap.add_argument("--nodes", type=int, default=1, help="nodes (default: %(default)s)")
    ap.add_argument("--devices-per-node", type=int, default=8, help="GPUs per node (default: %(default)s)")
    ap.add_argument("--gpu", choices=list(GPUS), default=None,
                    help="the device class: its peak, memory and float8 peak, and the efficiency measured on its "
                         f"generation (default: {DEFAULT_GPU}; --peak-tflops / --device-memory / --efficiency override)")
    ap.add_argument("--device-memory", type=float, default=None,
                    help=f"GiB per device (default: the --gpu's, {GPUS[DEFAULT_GPU].memory_gib:g} for {DEFAULT_GPU})")
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
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="dense bf16 TFLOP/s per device, for step time and MFU (default: the --gpu's, "
                         f"{GPUS[DEFAULT_GPU].peak_tflops:g} for {DEFAULT_GPU})")
    speed = ap.add_mutually_exclusive_group()
    speed.add_argument("--calibrate", metavar="RUN_DIR", default=None,
                    help="set --efficiency from a finished run (its summary.json: model FLOPs per step over its "
                         "measured step time and --peak-tflops, which must be the peak of the device it ran on)")
    speed.add_argument("--efficiency", type=float, default=None,
                    help="fraction of the peak a training step reaches (default: the MFU lightning_par measured on the "
                         "--gpu's generation, interpolated by parameter count: costs/measured.py)")
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
    when = ap.add_mutually_exclusive_group()
    when.add_argument("--no-checkpointing", action="store_true",
                      help="never activation checkpointing (default: each plan priced with and without it, the "
                           "faster that fits kept)")
    when.add_argument("--checkpointing", action="store_true", help="always activation checkpointing")
    ap.add_argument("--finetune", action="store_true",
                    help="the run fine-tunes the model: weigh LoRA (--lora-rank, the attention and MLP projections) "
                         "and QLoRA (its frozen base in NF4) beside full fine-tuning; full fine-tuning is chosen when "
                         "it fits at a step at most 2x theirs, else LoRA by the same rule against QLoRA, else QLoRA")
    ap.add_argument("--lora-rank", type=int, default=None,
                    help="with --finetune: the adapters' rank (default: 16; alpha is twice it)")
    args = ap.parse_args(argv)
    try:
        for name in ("nodes", "devices_per_node", "device_memory", "intra_node_gbs", "inter_node_gbs",
                     "micro_batch_size", "global_batch", "peak_tflops", "host_memory", "host_link_gbs", "nvme",
                     "nvme_gbs", "seq_len", "heads", "kv_heads", "intermediate", "mlp_ratio", "layers", "hidden",
                     "lora_rank"):
            value = getattr(args, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if args.lora_rank is not None and not args.finetune:
            raise ValueError("--lora-rank: only with --finetune")
        if args.efficiency is not None and not 0 < args.efficiency <= 1:
            raise ValueError(f"--efficiency must be in (0, 1], got {args.efficiency}")
        gpu = GPUS[args.gpu or DEFAULT_GPU]
        args.peak_tflops = args.peak_tflops or gpu.peak_tflops
        args.device_memory = args.device_memory or gpu.memory_gib
        calibration = calibrate(args.calibrate, args.peak_tflops) if args.calibrate else None
        asked = shape_from_args(args)
        measured = None
        if calibration is not None:
            args.efficiency = calibration.efficiency
        elif args.efficiency is None:
            measured = measured_efficiency(args.gpu or DEFAULT_GPU, asked.shape.units()["total"])
            args.efficiency = measured.value
        cluster = Cluster(args.nodes, args.devices_per_node, args.device_memory, args.intra_node_gbs,
                          args.inter_node_gbs, args.peak_tflops, args.efficiency, args.host_link_gbs, args.host_memory,
                          args.nvme, args.nvme_gbs, float8_tflops=gpu.float8_tflops)
        advice = advise(asked.shape, cluster, precision=args.precision, micro_batch_size=args.micro_batch_size,
                        checkpointing=False if args.no_checkpointing else True if args.checkpointing else None,
                        preset=asked.preset, global_batch=args.global_batch, pretrained=asked.pretrained,
                        finetune=args.finetune, lora_rank=args.lora_rank or LORA_RANK)
    except ValueError as exc:
        ap.error(str(exc))
    print(advice.headline())
    for line in model_lines(asked):
        print(line)
    if calibration is not None:
        print(calibration.line())
    elif measured is not None:
        print(measured.line(args.gpu or DEFAULT_GPU))
    if advice.methods:  # --finetune: what each method costs, the chosen one marked
        if advice.shape is not None and advice.shape.lora is not None:
            print("  " + describe(advice.shape)[2])
        print()
        print(advice.methods_table())
        print()
    if advice.chosen is not None:
        print(advice.memory_line())
    for r in advice.reasons:
        print(f"  - {r}")
    print()
    print(advice.table(advice.budget))
    print()
    if advice.strategy is None:
        sys.exit(2)
    print("Run it with:")
    print("  " + advice.command())
    if advice.install():
        print("It needs: " + advice.install())
    if asked.pretrained and not any(Path(asked.pretrained).glob("*.safetensors")):
        print(f"note: {asked.pretrained} holds no safetensors weights yet; model.pretrained reads them at the start "
              "of the run")
    return advice


def cli() -> None:
    """The ``lightning-par-advise`` console script."""
    main(prog="lightning-par-advise")


if __name__ == "__main__":
    main()
