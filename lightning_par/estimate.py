"""Memory per rank of every data-parallel strategy: the model of the ZeRO paper, plus activations.

Model states (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", Section 3.1 and Figure 1). With Ψ parameters, N data-parallel ranks and
bytes per parameter ``p`` (params), ``g`` (grads), ``k`` (optimizer state)::

    ddp / single   (p + g + k) Ψ                 the paper's "baseline"
    zero1  P_os    (p + g) Ψ + k Ψ / N
    zero2  P_os+g  p Ψ + (g + k) Ψ / N
    zero3  P_os+g+p, and fsdp:  (p + g + k) Ψ / N
    zero3_offload  0 on the device; the (p + g + k) Ψ / N shard lives in host memory (``offloaded``)

Sharded sizes use ceil(Ψ / N) elements (buffers are padded to a multiple of N). Transient
buffers are not counted: FSDP/ZeRO-3's all-gathered unit (about one block's full parameters,
two with prefetch) and ZeRO-2's full gradient between backward and the reduce-scatter.

Bytes per parameter describe what lightning_par stores (``optimizer`` adam/adamw: m and v;
sgd: the momentum buffer):

    precision      p  g  k (adam)            k (sgd)    activations
    32-true        4  4  8  (fp32 m, v)      4          32-bit
    bf16-mixed     4  4  8                   4          16-bit (autocast: fp32 weights, bf16 compute)
    16-mixed       4  4  8                   4          16-bit
    bf16-true      2  2  4  (bf16 m, v)      2          16-bit
    paper-mixed    2  2  12 (fp32 master+m+v) 8         16-bit   -- the paper's K = 12

So Lightning's "bf16-mixed" costs 16 Ψ like the paper's mixed precision, but as 4+4+8, not 2+2+12.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Section 4.1, Eq. 1): one transformer layer stores, in bytes at 16-bit,

    A_layer = s b h (34 + 5 a s / h)

(s sequence length, b micro-batch size, h hidden size, a heads; 34 s b h = attention 11 s b h +
MLP 19 s b h + two LayerNorms 4 s b h, 5 a s^2 b = QK^T scores, softmax output and its dropout
mask). We use L * A_layer and, for 32-bit activations ("32-true"), 2 * L * A_layer. With full
activation checkpointing only each layer's input is kept, 2 s b h bytes per layer (16-bit), and
one layer is recomputed at a time: L * 2 s b h + A_layer (both doubled for 32-bit). Not counted:
embeddings and the output layer/logits (small next to L layers, as the paper notes). The formula
is an upper bound for lightning_par's GPT: it has no dropout by default (1-byte masks absent) and
``scaled_dot_product_attention`` with a fused kernel never stores the s x s matrices.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from typing import Any

STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "paper-mixed")
OPTIMIZERS = ("adamw", "adam", "sgd")
GIB = 2**30

# precision -> (param bytes, grad bytes, bytes per optimizer-state element, master-copy bytes, activation bytes)
_LAYOUT = {
    "32-true": (4, 4, 4, 0, 4),
    "bf16-mixed": (4, 4, 4, 0, 2),
    "16-mixed": (4, 4, 4, 0, 2),
    "bf16-true": (2, 2, 2, 0, 2),
    "paper-mixed": (2, 2, 4, 4, 2),
}
_STATE_ELEMENTS = {"adamw": 2, "adam": 2, "sgd": 1}  # m and v; the momentum buffer
# which model states each strategy shards over N: (params, grads, optimizer state)
_SHARDED = {
    "single": (False, False, False),
    "ddp": (False, False, False),
    "zero1": (False, False, True),
    "zero2": (False, True, True),
    "zero3": (True, True, True),
    "zero3_offload": (True, True, True),
    "fsdp": (True, True, True),
}


@dataclass(frozen=True)
class Shape:
    """The transformer shape the activation formula needs (fields as in ``GPTConfig``)."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq_len: int


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by category; ``total`` is what sits on the device (``offloaded`` is host)."""

    strategy: str
    params: int
    grads: int
    optimizer_state: int
    offloaded: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state + self.activations

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def bytes_per_param(precision: str, optimizer: str = "adamw") -> tuple[int, int, int]:
    """(params, grads, optimizer state) bytes per parameter, unsharded: e.g. paper-mixed -> (2, 2, 12)."""
    _check(precision, PRECISIONS, "precision")
    _check(optimizer, OPTIMIZERS, "optimizer")
    p, g, s, master, _ = _LAYOUT[precision]
    return p, g, master + _STATE_ELEMENTS[optimizer] * s


def activation_bytes(shape: Shape, *, micro_batch_size: int = 1, precision: str = "bf16-mixed",
                     checkpointing: bool = False) -> int:
    """Korthikanti et al. 2022: L s b h (34 + 5 a s / h) bytes, or L 2 s b h + one layer with full
    checkpointing; doubled for 32-bit activations. See the module docstring."""
    _check(precision, PRECISIONS, "precision")
    s, b, h, a, L = shape.seq_len, micro_batch_size, shape.n_embd, shape.n_head, shape.n_layer
    layer = s * b * h * 34 + 5 * a * s * s * b  # = s b h (34 + 5 a s / h), exact in integers
    total = L * 2 * s * b * h + layer if checkpointing else L * layer
    return total * _LAYOUT[precision][4] // 2


def _resolve(model: Any, shape: Shape | None) -> tuple[int, Shape | None]:
    """(Ψ, shape) from a count, a preset name, or a ``GPTConfig``-like object (``n_params`` and
    ``n_layer``/``n_embd``/``n_head``/``vocab_size``, and ``seq_len`` or ``block_size``)."""
    if isinstance(model, str):
        psi, preset_shape = model_shape(model)
        return psi, shape or preset_shape
    if isinstance(model, (int, float)):
        return int(model), shape
    seq = getattr(model, "seq_len", None) or model.block_size
    return int(model.n_params), shape or Shape(model.n_layer, model.n_embd, model.n_head, model.vocab_size, seq)


def estimate(model: Any, *, devices: int, strategy: str, precision: str = "bf16-mixed",
             optimizer: str = "adamw", shape: Shape | None = None, micro_batch_size: int = 1,
             checkpointing: bool = False) -> MemoryEstimate:
    """Memory per rank on ``devices`` data-parallel ranks.

    ``model``: the parameter count Ψ, a preset name, or a ``GPTConfig``-like object. Activations
    are 0 when no shape is known (a bare count and no ``shape``); else per rank for one micro-batch.
    """
    _check(strategy, STRATEGIES, "strategy")
    n_params, shape = _resolve(model, shape)
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    n = 1 if strategy == "single" else devices
    psi = int(n_params)
    shard = -(-psi // n)  # ceil: buffers padded to a multiple of N
    sizes = [(shard if sharded else psi) * nbytes
             for sharded, nbytes in zip(_SHARDED[strategy], bytes_per_param(precision, optimizer))]
    act = activation_bytes(shape, micro_batch_size=micro_batch_size, precision=precision,
                           checkpointing=checkpointing) if shape else 0
    if strategy == "zero3_offload":
        return MemoryEstimate(strategy, 0, 0, 0, sum(sizes), act)
    return MemoryEstimate(strategy, *sizes, 0, act)


def estimate_all(model: Any, **kwargs: Any) -> list[MemoryEstimate]:
    """``estimate`` for every strategy, in ``STRATEGIES`` order."""
    return [estimate(model, strategy=s, **kwargs) for s in STRATEGIES]


def estimate_table(model: Any, *, devices: int, precision: str = "bf16-mixed", optimizer: str = "adamw",
                   shape: Shape | None = None, micro_batch_size: int = 1, checkpointing: bool = False,
                   device_memory: float | None = None, unit: str = "GiB", echo: bool = False) -> str:
    """One table: rows strategies, columns categories in ``unit`` (GiB = 2^30 bytes, GB = 1e9);
    with ``device_memory`` (in ``unit``) a last column says whether the device total fits."""
    scale = {"GiB": GIB, "GB": 1e9}[unit]
    n_params, shape = _resolve(model, shape)
    rows = estimate_all(n_params, devices=devices, precision=precision, optimizer=optimizer, shape=shape,
                        micro_batch_size=micro_batch_size, checkpointing=checkpointing)
    cols = ["params", "grads", "optimizer_state", "activations", "total", "offloaded"]
    p, g, k = bytes_per_param(precision, optimizer)
    lines = [f"Memory per rank in {unit}: Ψ = {int(n_params):,} params, N = {devices}, {precision} "
             f"({p}+{g}+{k} bytes/param), {optimizer}, "
             + (f"micro-batch {micro_batch_size} x {shape.seq_len} tokens" + (", checkpointing" if checkpointing else "")
                if shape else "activations not estimated (no model shape)")]
    widths = [max(len(c), 9) for c in cols]
    header = f"{'strategy':<14}" + "".join(f"  {c:>{w}}" for c, w in zip(cols, widths))
    if device_memory is not None:
        header += f"  fits {device_memory:g} {unit}"
    lines += [header, "-" * len(header)]
    for r in rows:
        d = r.as_dict()
        line = f"{r.strategy:<14}" + "".join(f"  {d[c] / scale:>{w}.3f}" for c, w in zip(cols, widths))
        if device_memory is not None:
            line += "  yes" if r.total <= device_memory * scale else "  NO"
        lines.append(line)
    table = "\n".join(lines)
    if echo:
        print(table)
    return table


def _check(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(allowed)}")


def model_shape(name: str, seq_len: int | None = None) -> tuple[int, Shape]:
    """(parameter count, shape) of a preset in ``lightning_par.models.gpt.PRESETS``."""
    from lightning_par.models.gpt import PRESETS, GPTConfig

    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = GPTConfig(**PRESETS[name])
    return cfg.n_params, Shape(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, seq_len or cfg.block_size)


_PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}


def run_estimate(cfg: Any) -> str:
    """``python run.py mode=estimate ...``: print the all-strategies table for the run's config.

    Reads the model config (a GPT preset plus any architecture overrides; other models are built
    on the meta device and counted, without an activation estimate), N = trainer.devices x
    trainer.num_nodes, trainer.precision (or ``paper-mixed``), the model's optimizer, the micro-batch
    data.global_batch_size / (N x accumulate_grad_batches) and data.seq_len, and the strategy's
    activation_checkpointing. Optional keys: ``+estimate.device_memory=80`` (adds a fits column),
    ``+estimate.unit=GB``, ``+estimate.params=7.5e9`` (a bare parameter count instead of the model).
    Raises ``ConfigError`` (one line) for unknown names.
    """
    from lightning_par import ConfigError

    opts = cfg.get("estimate") or {}
    try:
        devices = cfg.trainer.get("devices", 1)
        devices = 1 if devices in ("auto", -1, "-1") else (len(devices) if hasattr(devices, "__len__")
                                                           and not isinstance(devices, str) else int(devices))
        n = devices * int(cfg.trainer.get("num_nodes", 1))
        precision = str(cfg.trainer.get("precision", "32-true"))
        precision = _PRECISION_ALIASES.get(precision, precision)
        optimizer = str(cfg.model.get("optimizer", "adamw"))
        gbs = int(cfg.data.get("global_batch_size", n))
        accumulate = int(cfg.trainer.get("accumulate_grad_batches", 1))
        micro, note = gbs // (n * accumulate), ""
        if micro < 1 or gbs % (n * accumulate):
            micro = max(1, micro)
            note = (f"note: data.global_batch_size={gbs} does not split evenly over {n} ranks x {accumulate} "
                    f"accumulation steps; activations are for a micro-batch of {micro}\n")
        checkpointing = bool((cfg.get("strategy") or {}).get("activation_checkpointing", False))
        model, shape = _model_from_config(cfg, opts.get("params"))
        note = note if shape is not None else ""  # no activation estimate: the micro-batch does not matter
        table = estimate_table(model, devices=n, precision=precision, optimizer=optimizer, shape=shape,
                               micro_batch_size=micro, checkpointing=checkpointing,
                               device_memory=opts.get("device_memory"), unit=str(opts.get("unit", "GiB")))
    except (ValueError, KeyError) as e:
        raise ConfigError(str(e).strip("'\"")) from None
    print(note + table)
    return note + table


def _model_from_config(cfg: Any, params: float | None) -> tuple[Any, Shape | None]:
    """(Ψ or a GPTConfig-like model, shape) for the run's model config."""
    if params is not None:
        return int(float(params)), None
    model_cfg = cfg.model
    seq_len = cfg.data.get("seq_len") if cfg.get("data") else None
    if "preset" in model_cfg or str(model_cfg.get("_target_", "")).endswith("GPTModule"):
        from lightning_par.models.gpt import PRESETS, GPTConfig

        preset = model_cfg.get("preset")
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
        fields = dict(PRESETS[preset]) if preset else {}
        fields.update({k: v for k, v in model_cfg.items() if k in GPTConfig.__dataclass_fields__})
        gpt = GPTConfig(**fields)
        seq = int(model_cfg.get("seq_len") or seq_len or gpt.block_size)
        return gpt.n_params, Shape(gpt.n_layer, gpt.n_embd, gpt.n_head, gpt.vocab_size, seq)
    import torch
    from hydra.utils import instantiate

    with torch.device("meta"):
        module = instantiate(model_cfg)
    return sum(p.numel() for p in module.parameters()), None


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(prog="python -m lightning_par.estimate", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a GPT preset name (lightning_par.models.gpt.PRESETS)")
    src.add_argument("--params", type=float, help="parameter count, e.g. 7.5e9 (no activations)")
    ap.add_argument("--devices", type=int, default=1, help="data-parallel size N")
    ap.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    ap.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=None, help="default: the preset's block_size")
    ap.add_argument("--checkpointing", action="store_true", help="full activation checkpointing")
    ap.add_argument("--device-memory", type=float, default=None, help="device memory, in --unit")
    ap.add_argument("--unit", default="GiB", choices=("GiB", "GB"))
    args = ap.parse_args(argv)
    try:
        if args.model:
            model, shape = model_shape(args.model, args.seq_len)
        else:
            model, shape = args.params, None
        return estimate_table(model, devices=args.devices, precision=args.precision, optimizer=args.optimizer,
                              shape=shape, micro_batch_size=args.micro_batch_size, checkpointing=args.checkpointing,
                              device_memory=args.device_memory, unit=args.unit, echo=True)
    except ValueError as exc:
        ap.error(str(exc))


if __name__ == "__main__":
    main()
