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
must hold; ``states`` is the paper's figure. With LoRA (``Shape.lora``) Ψ's gradient and optimizer-state
terms count the trainable parameters only (the adapters), and QLoRA's NF4 base weighs ``states.nf4_bytes``.

What each strategy shards comes from the strategy catalogue (``strategies/catalog.py``:
``StrategyEntry.sharding`` and ``cost_layout``). ``mode=estimate`` and this model's command line
live in ``lightning_par/modes/estimate.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_par.costs.shape import Shape
from lightning_par.costs.peak import Layout, step_peak, zero2_staged
from lightning_par.costs.states import (
    OPTIMIZERS,
    PRECISIONS,
    bytes_per_param,
    check,
    disk_tier_resident,
    optimizer_state_bytes,
)
from lightning_par.core.dtypes import dtype_bytes, parse_dtype
from lightning_par.strategies.catalog import CATALOG, entry

__all__ = ["GIB", "OPTIMIZERS", "PRECISIONS", "STRATEGIES", "MemoryEstimate", "Shape", "bytes_per_param",
           "estimate", "estimate_all", "estimate_traced", "estimate_table", "hf_presets", "layout",
           "model_shape", "optimizer_state_bytes", "preset_names", "strategy_layout"]

GIB = 2**30
#: the data-parallel family, the rows of the default table (the catalogue's ``family`` entries)
STRATEGIES = tuple(e.name for e in CATALOG if e.family)

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
    #: bytes in the disk tier's files (zero3_offload with ``offload_dir``); ``offloaded`` is then the host's part
    on_disk: int = 0

    @property
    def total(self) -> int:
        return self.peak

    @property
    def states(self) -> int:
        """Model states on the device (the ZeRO paper's figure)."""
        return self.params + self.grads + self.optimizer_state

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total, "states": self.states}


def layout(strategy: str, devices: int, **options: Any) -> Layout:
    """The ``Layout`` of a strategy (its config name) on ``devices`` ranks: the catalogue entry's
    ``cost_layout`` (``tp``/``pp``/``replicate``/``data_parallel``/``ep`` as its constructor takes
    them, None: its defaults; further ``Layout`` fields)."""
    check(strategy, tuple(e.name for e in CATALOG), "strategy")
    return entry(strategy).cost_layout(devices, **options)


def estimate(model: Any, *, devices: int, strategy: str, precision: str = "bf16-mixed", optimizer: str = "adamw",
             shape: Shape | None = None, micro_batch_size: int = 1, checkpointing: bool | str = False,
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
                              r.transient, r.peak, r.moment, dict(lay.mesh), micro_batch_size, r.on_disk)
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
    if lay.cpu_offload:
        host, on_disk = int(params + grads + opt), 0
        if lay.disk_offload:  # no shapes: chunks of the step's size
            on_disk, host = host, disk_tier_resident(host, shard, 0)
        return MemoryEstimate(lay.strategy, 0, 0, 0, host, 0, 0, 0, "states only", dict(lay.mesh), on_disk=on_disk)
    temp = opt / 2 if device == "cpu" and "adam" in optimizer else 0
    if lay.grads == "zero2":  # the buckets staged for reduce-scatter (no shapes: parameters of a bucket's size)
        temp = max(temp, zero2_staged(lay, g, local, 0), min(2 * lay.bucket_bytes, p * shard))
    states = int(params + grads + opt)
    return MemoryEstimate(lay.strategy, int(params), int(grads), int(opt), 0, 0, int(temp), states + int(temp),
                          "optimizer step", dict(lay.mesh))


def estimate_traced(traced: Any, *, devices: int, strategy: str, layout_: Layout | None = None,
                    **layout_options: Any) -> MemoryEstimate:
    """Memory per rank of a data-parallel strategy for a model whose step was traced on one device
    (``costs/traced.py``: MemTracker on fake tensors, by category, at the peak of backward and of the
    optimizer step). The traced categories are re-held as the strategy holds them (the same rules as
    ``costs/peak.py``): parameters and optimizer states divided over the shard where it shards them;
    gradients whole in DDP's buckets and ZeRO-1/2 (ZeRO-2 adds the flat copy it reduce-scatters),
    sharded plus one unit's under FSDP; FSDP adds the gathered root and ``1 + prefetch`` blocks (the
    largest of the model's blocks) in the gather dtype; offload moves the states to the host.
    Activations and temporaries are the traced ones (data parallelism does not change a rank's
    micro-batch). Raises ValueError for a layout that splits the model (tp, pp, ep): its activations
    are not the traced ones."""
    lay = layout_ or layout(strategy, devices, **layout_options)
    if lay.tp > 1 or lay.pp > 1 or lay.ep > 1:
        raise ValueError(f"{strategy}: a traced model is priced under data-parallel strategies only "
                         f"(tp={lay.tp}, pp={lay.pp}, ep={lay.ep} split what was traced)")
    bwd, step = traced.backward, traced.step
    shard = lay.shard if lay.params_sharded or lay.opt_sharded or lay.grads in ("zero2", "fsdp") else 1
    # gradients exist for what trains (a LoRA model: its adapters), gathers move every parameter
    trains = traced.n_params if traced.trainable is None else traced.trainable
    unit_trains = traced.largest_unit if traced.largest_unit_trainable is None else traced.largest_unit_trainable
    full_grads = trains * traced.param_bytes
    params = bwd.params / shard if lay.params_sharded else bwd.params
    opt = bwd.optimizer_state / shard if lay.opt_sharded else bwd.optimizer_state
    step_opt = step.optimizer_state / shard if lay.opt_sharded else step.optimizer_state  # states + temporaries
    unit_grads = unit_trains * traced.param_bytes
    if lay.grads in ("accumulate",):
        grads_bwd, grads_step, extra = bwd.grads, full_grads, 0.0
    elif lay.grads == "bucket":  # DDP's buckets hold every gradient from the start
        grads_bwd, grads_step, extra = full_grads, full_grads, 0.0
    elif lay.grads == "zero2":  # the reduced shard and the staged buckets; chunks copied out for the gathers
        staged = zero2_staged(lay, traced.param_bytes, trains, traced.largest_tensor if trains == traced.n_params
                              else 0)
        grads_bwd, grads_step = full_grads / shard + min(bwd.grads, staged), full_grads / shard
        extra = min(2 * lay.bucket_bytes, trains * traced.param_bytes / shard)
    else:  # fsdp: reduce-scattered shards and the current unit's full gradient
        grads_bwd, grads_step, extra = bwd.grads / shard + unit_grads, full_grads / shard, 0.0
    gathered = 0.0
    if lay.grads == "fsdp" and shard > 1:
        gb = lay.gather_bytes or traced.param_bytes
        gathered = gb * (traced.root + traced.largest_unit * (1 + lay.prefetch))
    host = on_disk = 0.0
    if lay.cpu_offload:
        host, params, opt, step_opt, grads_step = params + opt + grads_step, 0.0, 0.0, 0.0, 0.0
        grads_bwd = unit_grads
        if lay.disk_offload:
            on_disk, host = host, disk_tier_resident(host, traced.n_params / shard, traced.largest_tensor)
    rest = bwd.buffers + bwd.other
    moments = {"backward": params + opt + grads_bwd + bwd.activations + bwd.temp + rest + gathered,
               "optimizer step": params + step_opt + grads_step + extra + step.temp + rest}
    moment = max(moments, key=moments.get)
    peak = int(moments[moment])
    states = int(params + grads_step + opt)
    return MemoryEstimate(lay.strategy, int(params), int(grads_step), int(opt), int(host), int(bwd.activations),
                          max(0, peak - states - int(bwd.activations)), peak, f"{moment} (traced)", dict(lay.mesh),
                          traced.micro_batch, int(on_disk))


def estimate_all(model: Any, strategies: tuple[str, ...] = STRATEGIES, **kwargs: Any) -> list[MemoryEstimate]:
    """``estimate`` for each strategy (default: ``STRATEGIES``), in order."""
    return [estimate(model, strategy=s, **kwargs) for s in strategies]


COLUMNS = ("params", "grads", "optimizer_state", "activations", "transient", "peak", "offloaded")


def estimate_table(model: Any, *, devices: int, precision: str = "bf16-mixed", optimizer: str = "adamw",
                   shape: Shape | None = None, micro_batch_size: int = 1, checkpointing: bool | str = False,
                   device_memory: float | None = None, unit: str = "GiB", echo: bool = False, device: str = "cuda",
                   rows: list[MemoryEstimate] | None = None, traced: bool = False) -> str:
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
                + (f", {checkpointing_words(checkpointing)} checkpointing"
                   if checkpointing else "") if shape
                else "one training step traced on fake tensors (costs/traced.py, CPU kernels)" if traced
                else "activations not estimated (no model shape)")
             + "; peak = the step's largest moment (costs/peak.py), not the columns' sum"]
    if shape is not None and shape.lora is not None:
        lo = shape.lora_units()
        lines.append(f"LoRA rank {shape.lora.rank}: {lo['trainable']:,} of the parameters train (gradients and "
                     "optimizer state); the rest are frozen weights"
                     + (", the adapted linears' in NF4 (QLoRA)" if shape.lora.base == "nf4" else ""))
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
    for r in rows:
        if r.on_disk:
            lines.append(f"{_row_name(r)}: disk tier (strategy.offload_dir): {r.on_disk / scale:.3f} {unit} of states in "
                         f"files; offloaded = the {r.offloaded / scale:.3f} {unit} of them the optimizer step pages into "
                         "host memory at a time")
    table = "\n".join(lines)
    if echo:
        print(table)
    return table


def _row_name(r: MemoryEstimate) -> str:
    mesh = "x".join(f"{k}{v}" for k, v in r.mesh.items() if k in ("pp", "tp", "dp_replicate", "ep") and v > 1)
    return f"{r.strategy} {mesh}".strip() if r.strategy not in STRATEGIES[:2] else r.strategy


def _resolve(model: Any, shape: Shape | None) -> tuple[int, Shape | None]:
    """(Ψ, shape) from a count, a preset name, a ``Shape`` or a config (``Shape.of``: a ``GPTConfig`` /
    ``MoEConfig`` or a transformers config)."""
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
    """(parameter count, shape) of the decoder that ``model=<name>`` builds: a GPT or MoE preset, or
    a Hugging Face one of ``conf/model`` (``hf_presets``). ``seq_len`` defaults to the preset's
    longest sequence (``block_size``; ``max_positions``)."""
    from lightning_par.models.gpt import PRESETS
    from lightning_par.models.module import GPTModule
    from lightning_par.models.moe import PRESETS as MOE_PRESETS
    from lightning_par.models.moe_module import MoEModule

    if name not in PRESETS and name not in MOE_PRESETS:
        if name not in hf_presets():
            raise ValueError(f"unknown model {name!r}; choose one of {', '.join(preset_names())}")
        shape = _hf_preset_shape(name, seq_len)
        return shape.units()["total"], shape
    module = GPTModule(preset=name) if name in PRESETS else MoEModule(preset=name)
    block = module.config.block_size
    if seq_len is not None and seq_len > block:  # its learned position table: training refuses it too
        raise ValueError(f"model={name} has {block} positions (block_size); a sequence of {seq_len} tokens does "
                         f"not fit it: ask with --seq-len {block} or less")
    shape = Shape.of_model(module, seq_len)
    return shape.units()["total"], shape


def preset_names() -> list[str]:
    """Every name ``model_shape`` accepts: the GPT and MoE presets, then the Hugging Face ones."""
    from lightning_par.models.gpt import PRESETS
    from lightning_par.models.moe import PRESETS as MOE_PRESETS

    return [*PRESETS, *MOE_PRESETS, *hf_presets()]


def hf_presets() -> tuple[str, ...]:
    """The ``conf/model`` configs that build a Hugging Face decoder the estimator has a shape for
    (``models/hf/causal_lm.py``'s ``HFCausalLM`` of an architecture in ``costs.shape.HF_ARCHS``): read
    from the YAML files themselves, following each one's ``defaults`` within the model group."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    from lightning_par.costs.shape import HF_ARCHS

    group = files("lightning_par.conf") / "model"

    def field(name: str, key: str) -> str:
        node = OmegaConf.load(str(group / f"{name}.yaml"))
        if key in node:
            return str(node[key])
        parents = [d for d in node.get("defaults", []) if isinstance(d, str) and d != "_self_"]
        return next((v for d in reversed(parents) if (v := field(d, key))), "")

    names = sorted(f.name.removesuffix(".yaml") for f in group.iterdir() if f.name.endswith(".yaml"))
    return tuple(n for n in names if field(n, "_target_").endswith(".HFCausalLM") and field(n, "arch") in HF_ARCHS)


def _hf_preset_shape(name: str, seq_len: int | None) -> Shape:
    """The shape of the Hugging Face model ``model=<name>`` builds: the app's config composed with that
    override (and ``data.seq_len``), the model instantiated as a run does (``HFCausalLM`` makes the
    transformers config; no layer is built), its shape as it declares it (``cost_shape``: ``Shape.of_hf``)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from lightning_par.models.build import instantiate_model

    overrides = [f"model={name}"] + ([f"data.seq_len={seq_len}"] if seq_len else [])
    if GlobalHydra.instance().is_initialized():  # inside a Hydra app: compose beside it (as run/facts.py does)
        cfg = compose("config", overrides=overrides).model
    else:
        with initialize_config_module("lightning_par.conf", version_base="1.3"):
            cfg = compose("config", overrides=overrides).model
    try:
        module = instantiate_model(cfg)
    except Exception as e:  # hydra wraps the constructor's error: show the cause in one line
        cause = e.__cause__ or e
        raise ValueError(f"model={name}: {type(cause).__name__}: {cause}") from None
    # without seq_len: the longest sequence the model takes (max_positions; the tiny presets tie it to data.seq_len)
    return Shape.of_model(module, seq_len)


def strategy_layout(name: str, strategy: Any, dims: Any, tiling: dict[str, int], accumulate: int = 1) -> Layout:
    """The ``Layout`` of a built strategy on its mesh: its catalogue entry's, with what the strategy states
    about itself (``strategy.cost_options()``: offload, prefetch, schedule, ...); ``accumulate``:
    micro-batches per step (FSDP's ``grad_sync=last_micro_batch`` then holds full gradients)."""
    e = entry(name)
    o = strategy.cost_options()
    fsdp_data = e.sharding_for(o.data_parallel or e.defaults().get("data_parallel")).grads == "fsdp"
    base = e.cost_layout(dims.world_size, tp=dims.tp, pp=dims.pp, ep=dims.ep,
                         replicate=dims.dp_replicate if fsdp_data else 1, data_parallel=o.data_parallel)
    offload = base.cpu_offload or o.cpu_offload
    return replace(base, cpu_offload=offload, disk_offload=o.disk_offload,
                   float8_gather=o.float8 == "tensorwise" and base.grads == "fsdp" and not offload,
                   prefetch=o.prefetch, tiling=dict(tiling),
                   gather_bytes=dtype_bytes(parse_dtype(o.param_dtype, "param_dtype")) if o.param_dtype else None,
                   schedule=o.schedule, n_microbatches=o.n_microbatches, virtual_stages=o.virtual_stages,
                   sequence_parallel=o.sequence_parallel, loss_parallel=o.loss_parallel,
                   unsharded_grads=accumulate > 1 and o.grad_sync == "last_micro_batch",
                   reshard_after_forward=o.reshard_after_forward is not False, mesh=dims.sizes())


def checkpointing_words(checkpointing: bool | str | int) -> str:
    """``selective``, ``full`` or ``every k-th block``, for a table's header."""
    if type(checkpointing) is int and checkpointing >= 2:
        return f"every {checkpointing}th block"
    return "selective" if checkpointing == "selective" else "full"
