"""Memory per rank of every strategy: model states (the ZeRO paper's formulas), activations of
today's kernels and the transient peak of a step. Theory and terms: docs/cost_model.md.

Model states (Rajbhandari et al. 2020, Section 3.1): with Ψ parameters over N ranks and ``p``,
``g``, ``k`` bytes per parameter (``costs/states.py``)::

    ddp / single   (p + g + k) Ψ          zero1  (p + g) Ψ + k Ψ / N        zero2  p Ψ + (g + k) Ψ / N
    zero3 / fsdp   (p + g + k) Ψ / N      zero3_offload: that shard in host memory (``offloaded``)

On top of them ``costs/peak.py`` walks the step: activations (``costs/activations.py``: fused SDPA
vs the math path, logits and fp32 loss buffers, dropout masks, checkpointing, pipeline micro-batches
in flight, TP/SP sharding) and the transient buffers (ZeRO-2's full gradients, FSDP's all-gathered
units with prefetch, the optimizer step's temporaries). ``peak`` (also ``total``) is what a device
must hold; ``states`` is the paper's figure.

Every strategy declares what it shards in ``SHARDING`` below (a strategy config without an entry
fails ``tests/test_estimate.py``).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_par.costs.activations import Shape
from lightning_par.costs.peak import Layout, step_peak
from lightning_par.costs.states import OPTIMIZERS, PRECISIONS, bytes_per_param, check, optimizer_state_bytes
from lightning_par.dtypes import canonical_precision, dtype_bytes, parse_dtype

__all__ = ["GIB", "OPTIMIZERS", "PRECISIONS", "SHARDING", "STRATEGIES", "MemoryEstimate", "Shape", "bytes_per_param",
           "estimate", "estimate_all", "estimate_table", "layout", "model_shape", "optimizer_state_bytes",
           "run_estimate"]

GIB = 2**30
#: the data-parallel family, the rows of the default table
STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp")
#: what each strategy (its config group name) shards and how it holds gradients (costs/peak.py):
#: (params sharded, optimizer state sharded, gradient mode, offload); mesh strategies take tp/pp
SHARDING: dict[str, tuple[bool, bool, str, bool] | None] = {
    "single": (False, False, "accumulate", False),
    "ddp": (False, False, "bucket", False),
    "zero1": (False, True, "bucket", False),
    "zero2": (False, True, "zero2", False),
    "zero3": (True, True, "fsdp", False),
    "zero3_offload": (True, True, "fsdp", True),
    "fsdp": (True, True, "fsdp", False),
    "hsdp": (True, True, "fsdp", False),
    "tensor_parallel": (False, False, "accumulate", False),
    "pipeline": (False, False, "accumulate", False),
    "fsdp_tp": (True, True, "fsdp", False),
    "3d": (True, True, "fsdp", False),  # data_parallel=replicate: accumulate (see ``layout``)
    # MoE models: experts over ep; data_parallel=replicate: the rest replicated (see ``layout``)
    "expert_parallel": (True, True, "fsdp", False),
}
#: strategy class -> config group name (what ``mode=estimate`` reads from the built strategy)
_BY_CLASS = {"SingleDeviceStrategy": "single", "DDPStrategy": "ddp", "Zero1Strategy": "zero1",
             "Zero2Strategy": "zero2", "Zero3Strategy": "zero3", "Zero3OffloadStrategy": "zero3_offload",
             "FSDPStrategy": "fsdp", "TensorParallelStrategy": "tensor_parallel", "PipelineStrategy": "pipeline",
             "FSDPTPStrategy": "fsdp_tp", "Parallel3DStrategy": "3d", "ExpertParallelStrategy": "expert_parallel"}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank; ``peak`` (= ``total``) is what the device must hold, ``offloaded`` is host memory."""

    strategy: str
    params: int
    grads: int
    optimizer_state: int
    offloaded: int
    activations: int
    transient: int = 0
    peak: int = 0
    moment: str = ""
    mesh: dict[str, int] = field(default_factory=dict)
    micro_batch_size: int | None = None

    @property
    def total(self) -> int:
        return self.peak

    @property
    def states(self) -> int:
        """Model states on the device (the ZeRO paper's figure)."""
        return self.params + self.grads + self.optimizer_state

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total, "states": self.states}


def layout(strategy: str, devices: int, *, tp: int | None = None, pp: int | None = None, replicate: int = 1,
           data_parallel: str = "fsdp", ep: int | None = None, **options: Any) -> Layout:
    """The ``Layout`` of a strategy on ``devices`` ranks. ``tp``/``pp`` as the mesh strategies take them
    (None: the defaults of their configs); ``ep``: expert_parallel's degree (None: every rank);
    ``options``: further ``Layout`` fields."""
    if strategy == "expert_parallel":
        return _expert_parallel_layout(devices, ep or devices, data_parallel, **options)
    if ep is not None and ep > 1:
        raise ValueError(f"the estimator prices expert parallelism with strategy=expert_parallel only, not ep={ep} "
                         f"with {strategy}")
    check(strategy, tuple(SHARDING), "strategy")
    declared = SHARDING[strategy]
    if declared is None:
        raise ValueError(f"the estimator has no model for strategy {strategy} (MoE); estimate a dense model")
    params_sharded, opt_sharded, grads, offload = declared
    n = 1 if strategy == "single" else devices
    tp = tp if tp is not None else {"tensor_parallel": n, "fsdp_tp": 2, "3d": 2}.get(strategy, 1)
    pp = pp if pp is not None else {"pipeline": n, "3d": 2}.get(strategy, 1)
    if n % (tp * pp):
        raise ValueError(f"{strategy}: tp={tp} x pp={pp} does not divide the world size {n}")
    dp = n // (tp * pp)
    if strategy == "3d" and data_parallel == "replicate":
        params_sharded, opt_sharded, grads = False, False, "accumulate"
    shard = dp // replicate if grads in ("fsdp", "zero2") or opt_sharded else 1
    mesh = {k: v for k, v in (("pp", pp), ("dp_replicate", dp // max(1, shard)), ("dp_shard", shard), ("tp", tp))
            if v > 1} or {"dp_shard": 1}
    return Layout(strategy=strategy, shard=max(1, shard), params_sharded=params_sharded, opt_sharded=opt_sharded,
                  grads=grads, offload=offload or bool(options.pop("cpu_offload", False)), tp=tp, pp=pp,
                  mesh=mesh, **options)


def _expert_parallel_layout(devices: int, ep: int, data_parallel: str, **options: Any) -> Layout:
    """``strategy=expert_parallel``: the routed experts split over ``ep`` ranks; the rest replicated
    (``replicate``: gradients all-reduced after backward) or, with ``fsdp``, the non-expert
    parameters sharded over the whole world and the experts' own shards over dp = world / ep (none
    when ep is the whole world: the experts stay ep shards outside FSDP; strategies/expert_parallel.py)."""
    if ep < 1 or devices % ep:
        raise ValueError(f"expert_parallel: ep={ep} does not divide the world size {devices}")
    dp = devices // ep
    if data_parallel == "fsdp":  # with ep = world (dp = 1) the experts stay ep shards outside FSDP
        return Layout(strategy="expert_parallel", shard=devices, params_sharded=True, opt_sharded=True, grads="fsdp",
                      ep=ep, expert_shard=dp, mesh={k: v for k, v in (("dp_shard", dp), ("ep", ep)) if v > 1},
                      **options)
    return Layout(strategy="expert_parallel", grads="accumulate", ep=ep,
                  mesh={k: v for k, v in (("dp_replicate", dp), ("ep", ep)) if v > 1}, **options)


def estimate(model: Any, *, devices: int, strategy: str, precision: str = "bf16-mixed", optimizer: str = "adamw",
             shape: Shape | None = None, micro_batch_size: int = 1, checkpointing: bool = False,
             device: str = "cuda", layout_: Layout | None = None, **layout_options: Any) -> MemoryEstimate:
    """Memory per rank. ``model``: a parameter count Ψ, a preset name, a ``GPTConfig``-like object or a
    ``Shape``. Without a shape (a bare count) only model states and the optimizer step are counted.
    ``layout_options``: ``tp``, ``pp``, ``replicate``, ``data_parallel`` and ``Layout`` fields."""
    check(precision, PRECISIONS, "precision")
    check(optimizer, OPTIMIZERS, "optimizer")
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    n_params, shape = _resolve(model, shape)
    lay = layout_ or layout(strategy, devices, **layout_options)
    if shape is not None:
        r = step_peak(shape, lay, micro_batch_size=micro_batch_size, precision=precision, optimizer=optimizer,
                      checkpointing=checkpointing, device=device)
        return MemoryEstimate(lay.strategy, r.params, r.grads, r.optimizer_state, r.offloaded, r.activations,
                              r.transient, r.peak, r.moment, dict(lay.mesh), micro_batch_size)
    if lay.ep > 1:
        raise ValueError("expert parallelism needs the model's shape (which parameters are experts), not a bare count")
    return _states_only(int(n_params), lay, precision, optimizer, device)


def _states_only(psi: int, lay: Layout, precision: str, optimizer: str, device: str) -> MemoryEstimate:
    p, g, _ = bytes_per_param(precision, optimizer)
    local = -(-psi // (lay.tp * lay.pp))
    shard = -(-local // lay.shard)
    params = p * (shard if lay.params_sharded else local)
    grads = g * (shard if lay.grads in ("zero2", "fsdp") else local)
    opt = optimizer_state_bytes(shard if lay.opt_sharded else local, optimizer, precision)
    if lay.offload:
        return MemoryEstimate(lay.strategy, 0, 0, 0, int(params + grads + opt), 0, 0, 0, "states only",
                              dict(lay.mesh))
    temp = 2 * g * local if lay.grads == "zero2" else (opt / 2 if device == "cpu" and "adam" in optimizer else 0)
    states = int(params + grads + opt)
    return MemoryEstimate(lay.strategy, int(params), int(grads), int(opt), 0, 0, int(temp), states + int(temp),
                          "optimizer step", dict(lay.mesh))


def estimate_all(model: Any, strategies: tuple[str, ...] = STRATEGIES, **kwargs: Any) -> list[MemoryEstimate]:
    """``estimate`` for each strategy (default: ``STRATEGIES``), in order."""
    return [estimate(model, strategy=s, **kwargs) for s in strategies]


COLUMNS = ("params", "grads", "optimizer_state", "activations", "transient", "peak", "offloaded")


def estimate_table(model: Any, *, devices: int, precision: str = "bf16-mixed", optimizer: str = "adamw",
                   shape: Shape | None = None, micro_batch_size: int = 1, checkpointing: bool = False,
                   device_memory: float | None = None, unit: str = "GiB", echo: bool = False, device: str = "cuda",
                   rows: list[MemoryEstimate] | None = None) -> str:
    """One table: rows strategies (and mesh), columns the categories in ``unit`` (GiB = 2^30, GB = 1e9);
    with ``device_memory`` (in ``unit``) a last column says whether the predicted peak fits."""
    scale = {"GiB": GIB, "GB": 1e9}[unit]
    n_params, shape = _resolve(model, shape)
    rows = rows or estimate_all(n_params if shape is None else shape, devices=devices, precision=precision,
                                optimizer=optimizer, shape=shape, micro_batch_size=micro_batch_size,
                                checkpointing=checkpointing, device=device)
    p, g, k = bytes_per_param(precision, optimizer)
    lines = [f"Memory per rank in {unit}: Ψ = {int(n_params):,} params, N = {devices}, {precision} "
             f"({p:g}+{g:g}+{k:g} bytes/param), {optimizer}, "
             + (f"micro-batches of {shape.seq_len} tokens on {device}"
                + (", checkpointing" if checkpointing else "") if shape
                else "activations not estimated (no model shape)")
             + "; peak = the step's largest moment (costs/peak.py), not the columns' sum"]
    widths = [max(len(c), 9) for c in COLUMNS]
    header = f"{'strategy':<24}{'micro':>6}" + "".join(f"  {c:>{w}}" for c, w in zip(COLUMNS, widths))
    if device_memory is not None:
        header += f"  fits {device_memory:g} {unit}"
    lines += [header, "-" * len(header)]
    for r in rows:
        d = r.as_dict()
        micro = r.micro_batch_size if r.micro_batch_size is not None else (micro_batch_size if shape else "-")
        line = f"{_row_name(r):<24}{micro:>6}" + "".join(f"  {d[c] / scale:>{w}.3f}" for c, w in zip(COLUMNS, widths))
        if device_memory is not None:
            line += "  yes" if r.peak <= device_memory * scale else "  NO"
        lines.append(line)
    table = "\n".join(lines)
    if echo:
        print(table)
    return table


def _row_name(r: MemoryEstimate) -> str:
    mesh = "x".join(f"{k}{v}" for k, v in r.mesh.items() if k in ("pp", "tp", "dp_replicate", "ep") and v > 1)
    return f"{r.strategy} {mesh}".strip() if r.strategy not in STRATEGIES[:2] else r.strategy


def _resolve(model: Any, shape: Shape | None) -> tuple[int, Shape | None]:
    """(Ψ, shape) from a count, a preset name, a ``Shape`` or a ``GPTConfig``-like object."""
    if isinstance(model, str):
        psi, preset_shape = model_shape(model)
        return psi, shape or preset_shape
    if isinstance(model, Shape):
        return model.units()["total"], model
    if isinstance(model, (int, float)):
        return int(model), shape
    shape = shape or Shape.of(model)
    return shape.units()["total"], shape


def model_shape(name: str, seq_len: int | None = None) -> tuple[int, Shape]:
    """(parameter count, shape) of the GPT or MoE decoder that ``model=<name>`` builds (its preset)."""
    from lightning_par.models.gpt import PRESETS
    from lightning_par.models.module import GPTModule
    from lightning_par.models.moe import PRESETS as MOE_PRESETS
    from lightning_par.models.moe_module import MoEModule

    if name not in PRESETS and name not in MOE_PRESETS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join([*PRESETS, *MOE_PRESETS])}")
    module = GPTModule(preset=name) if name in PRESETS else MoEModule(preset=name)
    shape = Shape.of(module.config, seq_len)
    return shape.units()["total"], shape


def run_estimate(cfg: Any) -> str:
    """``python run.py mode=estimate ...``: the table for the run's config, and ``estimate.json``.

    Rows: the data-parallel family at N ranks and, when the configured strategy is another, that
    strategy with its own mesh (``dims_for``). N, the per-rank micro-batch and the mesh come from
    ``lightning_par.facts`` (as training computes them); the model's shape from the module the model
    config builds. Optional keys: ``+estimate.device_memory=80`` (a fits column, in ``unit``),
    ``+estimate.unit=GB``, ``+estimate.params=7.5e9`` (a bare count instead of the model),
    ``+estimate.device=cpu`` (default: cuda unless ``trainer.accelerator=cpu``).
    Writes ``<run dir>/estimate.json`` (bytes). Raises ``ConfigError`` (one line) for bad input.
    """
    from lightning_par import ConfigError
    from lightning_par import facts

    opts = cfg.get("estimate") or {}
    try:
        n = facts.world_size(cfg)
        precision = str(cfg.trainer.get("precision", "32-true"))
        precision = canonical_precision(precision)  # Lightning's short forms: bf16 -> bf16-mixed
        optimizer = str(cfg.model.get("optimizer", "adamw"))
        device = str(opts.get("device") or ("cpu" if str(cfg.trainer.get("accelerator")) == "cpu" else "cuda"))
        strategy, tiling = facts.strategy_of(cfg.strategy)
        name = _BY_CLASS.get(type(strategy).__name__)
        if name is None:
            raise ValueError(f"the estimator has no model for strategy {type(strategy).__name__}")
        dims = facts.mesh_of(strategy, n)
        gbs = int(cfg.data.get("global_batch_size", n))
        micro = facts.micro_batch_size(gbs, dims.dp, int(cfg.trainer.get("accumulate_grad_batches", 1)))
        checkpointing = bool(getattr(strategy, "activation_checkpointing", False))
        params = opts.get("params")
        shape = None if params is not None else facts.gpt_shape(cfg.model, cfg.data.get("seq_len"))
        model: Any = int(float(params)) if params is not None else (shape or _count_params(cfg.model))
        accumulate = int(cfg.trainer.get("accumulate_grad_batches", 1))
        kw = dict(devices=n, precision=precision, optimizer=optimizer, checkpointing=checkpointing, device=device)
        rows, notes = [], []
        family = [s for s in STRATEGIES if s != name] if n > 1 else []
        for row in family:  # the data-parallel family: dp = N (single: one device)
            dp = 1 if row == "single" else n
            row_micro = max(1, gbs // (dp * accumulate))
            if gbs % (dp * accumulate):
                notes = [f"note: data.global_batch_size={gbs} does not split over {dp} ranks x {accumulate}; the "
                         f"data-parallel rows assume a micro-batch of {row_micro}"]
            rows.append(replace(estimate(model, strategy=row, micro_batch_size=row_micro, **kw),
                                micro_batch_size=row_micro))
        rows.append(replace(estimate(model, strategy=name, micro_batch_size=micro,
                                     layout_=strategy_layout(name, strategy, dims, tiling), **kw), micro_batch_size=micro))
        rows.sort(key=lambda r: list(SHARDING).index(r.strategy))
        table = "\n".join(notes + [estimate_table(model, rows=rows, device_memory=opts.get("device_memory"),
                                                   unit=str(opts.get("unit", "GiB")), micro_batch_size=micro, **kw)])
    except (ValueError, KeyError) as e:
        raise ConfigError(str(e).strip("'\"")) from None
    out_dir = str(cfg.paths.output_dir)
    os.makedirs(out_dir, exist_ok=True)
    record = {"world_size": n, "strategy": name, "mesh": dims.sizes(), "precision": precision,
              "optimizer": optimizer, "micro_batch_size": micro, "checkpointing": checkpointing, "device": device, "seq_len": shape.seq_len if shape else None,
              "n_params": model if isinstance(model, int) else model.units()["total"],
              "strategies": [r.as_dict() for r in rows]}
    with open(os.path.join(out_dir, "estimate.json"), "w") as f:
        json.dump(record, f, indent=2)
    print(table)
    return table


def strategy_layout(name: str, strategy: Any, dims: Any, tiling: dict[str, int]) -> Layout:
    """The ``Layout`` of a built strategy on its mesh (its options: offload, prefetch, schedule, ...)."""
    base = layout(name, dims.world_size, tp=dims.tp, pp=dims.pp, replicate=dims.dp_replicate if
                  SHARDING[name] and SHARDING[name][2] == "fsdp" and name != "expert_parallel" else 1,
                  data_parallel=getattr(strategy, "data_parallel", "fsdp"), ep=dims.ep)
    pd = getattr(strategy, "param_dtype", None)  # FSDP mixed precision: bf16 gathers move 2 bytes per parameter
    n_micro = getattr(strategy, "_n_microbatches", None)
    return replace(base, offload=base.offload or bool(getattr(strategy, "cpu_offload", False)),
                   prefetch=int(getattr(strategy, "prefetch", 1)), tiling=dict(tiling),
                   gather_bytes=dtype_bytes(parse_dtype(pd, "param_dtype")) if pd else None,
                   schedule=str(getattr(strategy, "schedule", "1f1b")), n_microbatches=n_micro,
                   virtual_stages=int(getattr(strategy, "virtual_stages", 1) or 1),
                   sequence_parallel=bool(getattr(strategy, "sequence_parallel", False)),
                   loss_parallel=bool(getattr(strategy, "loss_parallel", False)),
                   mesh=dims.sizes())


def _count_params(model_cfg: Any) -> int:
    import torch
    from hydra.utils import instantiate

    module = instantiate(model_cfg)
    with torch.device("meta"):
        module.configure_model()
    return sum(p.numel() for p in module.parameters())


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
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="which kernels run")
    ap.add_argument("--device-memory", type=float, default=None, help="device memory, in --unit")
    ap.add_argument("--unit", default="GiB", choices=("GiB", "GB"))
    args = ap.parse_args(argv)
    try:
        model, shape = model_shape(args.model, args.seq_len) if args.model else (args.params, None)
        return estimate_table(model, devices=args.devices, precision=args.precision, optimizer=args.optimizer,
                              shape=shape, micro_batch_size=args.micro_batch_size, checkpointing=args.checkpointing,
                              device_memory=args.device_memory, unit=args.unit, echo=True, device=args.device)
    except ValueError as exc:
        ap.error(str(exc))


if __name__ == "__main__":
    main()
