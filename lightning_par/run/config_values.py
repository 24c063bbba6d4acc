"""Every config value's type and range, checked before anything is built: one table, one line per mistake.

``check_config_values(cfg)`` walks ``TABLE`` (one declaration per key: what the value may be) over the
composed config and raises ``ConfigError`` for the first value that does not fit, as

    data.seq_len=0: expected an integer >= 1 (tokens per sample)

which the app prints as one ``error:`` line before any model, data module or process exists. The value
is echoed as the command line gave it (Hydra's overrides; else as the config holds it), made printable
and cut to ``ECHO_CHARS`` characters, so a value of any length or alphabet still gives one short line.

What the table checks and what it leaves, one place per concern:

- **here**: each key's type and range on its own (``data.val_fraction`` in [0, 1), ``model.lr`` a
  positive finite number, step counts >= 1 where 0 would mean "never", clip values >= 0, ...);
- **the constructors and checks that own a key** (``CHECKED_ELSEWHERE``: key -> the callables that check
  it, imported when first read, so a renamed or moved checker fails tests/test_config_values.py): names chosen
  from a list the code already spells out in one line (``model.optimizer``, ``scheduler.name``,
  ``strategy.schedule``, ...), the mesh strategies' ``pp``/``tp``/``ep`` (their constructors check
  type and range), FSDP's options (``FSDPOptions.check``: ``param_dtype``/``reduce_dtype`` against
  the one dtype table ``lightning_par/core/dtypes.py``, ``prefetch``), paths (checked by opening them);
- **the code that sees several keys at once**: rules between keys stay where both values are known
  (``top_k <= n_experts``, ``seq_len <= block_size``, a size that must divide the world, a pipeline's
  micro-batches against its stages, ``prefetch_factor`` needing ``num_workers > 0``). Some of those
  constructors also compare a single value (``moe_every < 1``); they keep that for library users, but
  a string there used to end as a ``TypeError`` -- the table now answers first.

A rule applies to a node built from lightning_par's or Lightning's own class (its ``_target_``), or to a
node without one (``scheduler``, ``find_batch_size``, ``estimate``, top-level keys): a model or data
module of the user's own keeps its keys' meanings to itself. A key that is absent is not checked.
Interpolated values (``model.seq_len: ${data.seq_len}``) are checked after every plain one, so the key
the user set is the one named.

Called once per launch, by the launching process before any rank starts: the app's ``cli._run``, for every
mode (train, find_batch_size, estimate; ``mode`` itself is checked here too, against ``MODES``). Nothing
after it checks the table again: not ``train.build``/``train.train``, not the child ranks
(``lightning_par.run.child``, which read the config the launcher checked and resolved), not
``mode=find_batch_size``'s build; each of its tries is a launch of its own. What needs the built
objects (``train.validate``, the constructors) still runs where they are built. A program that calls
``train.train`` itself, without the app, calls ``check_config_values`` first.
Entry layer: reads OmegaConf nodes (and Hydra's overrides); nothing below the app imports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_par import ConfigError

__all__ = ["CHECKED_ELSEWHERE", "ECHO_CHARS", "MODES", "NOT_CHECKED", "TABLE", "Spec", "check_config_values",
           "coverage", "echo", "leaf_keys"]

#: the longest echo of a value in an error line
ECHO_CHARS = 60


# ---------------------------------------------------------------------------------------------------
# what a value may be


@dataclass(frozen=True)
class Spec:
    """A test on one value and the words for what it accepts; ``a | b`` accepts either."""

    test: Callable[[Any], bool]
    expected: str

    def __or__(self, other: Spec) -> Spec:
        return Spec(lambda v: self.test(v) or other.test(v), f"{self.expected} or {other.expected}")

    def note(self, text: str) -> Spec:
        """The same test; ``text`` (the key's meaning) after the expectation."""
        return Spec(self.test, f"{self.expected} ({text})")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bounds(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {hi:g}"
    return ""


def _within(v: float, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> bool:
    return ((lo is None or (v > lo if lo_open else v >= lo))
            and (hi is None or (v < hi if hi_open else v <= hi)))


def integer(lo: int | None = None, hi: int | None = None) -> Spec:
    """An int (not a bool, not 3.0) within [lo, hi]."""
    return Spec(lambda v: _is_int(v) and _within(v, lo, hi, False, False),
                f"an integer {_bounds(lo, hi, False, False)}".rstrip())


def number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
           hi_open: bool = False) -> Spec:
    """A finite int or float within the bounds (open or closed): never NaN or infinite."""
    return Spec(lambda v: _is_number(v) and _within(v, lo, hi, lo_open, hi_open),
                f"a finite number {_bounds(lo, hi, lo_open, hi_open)}".rstrip())


def exactly(value: Any, text: str | None = None) -> Spec:
    return Spec(lambda v: type(v) is type(value) and v == value, text or str(value))


def choice(*names: str) -> Spec:
    return Spec(lambda v: isinstance(v, str) and v in names, f"one of {', '.join(names)}")


def int_list(lo: int, *, length: int | None = None) -> Spec:
    words = f"a list of {length} integers" if length else "a non-empty list of integers"
    return Spec(lambda v: isinstance(v, list) and len(v) > 0 and (length is None or len(v) == length)
                and all(_is_int(x) and x >= lo for x in v), f"{words} >= {lo}")


def number_list(length: int, lo: float, hi: float, *, hi_open: bool = False) -> Spec:
    return Spec(lambda v: isinstance(v, list) and len(v) == length
                and all(_is_number(x) and _within(x, lo, hi, False, hi_open) for x in v),
                f"a list of {length} numbers {_bounds(lo, hi, False, hi_open)}")


NULL = exactly(None, "null")
BOOL = Spec(lambda v: isinstance(v, bool), "true or false")


def _torch_device(v: Any) -> bool:
    import torch

    if not isinstance(v, str):
        return False
    try:
        torch.device(v)
    except (RuntimeError, ValueError):
        return False
    return True


def _backends(v: Any) -> bool:
    """torch.distributed's backend names, alone or per device (``cpu:gloo,cuda:nccl``)."""
    import torch.distributed as dist

    known = {b for b in getattr(dist.Backend, "backend_list", ("gloo", "nccl", "mpi", "ucc")) if b != "undefined"}
    if not isinstance(v, str) or not v:
        return False
    return all(part.rpartition(":")[2].strip().lower() in known for part in v.split(","))


def _accelerators() -> tuple[str, ...]:
    try:
        from lightning.pytorch.accelerators import AcceleratorRegistry

        names = sorted(AcceleratorRegistry.available_accelerators())
    except Exception:  # noqa: BLE001 -- an older Lightning: its long-standing names
        names = ["cpu", "cuda", "mps", "tpu"]
    return ("auto", "gpu", *names)


# ---------------------------------------------------------------------------------------------------
# the table: one declaration per key (meanings from the yaml comments and the code reading the key)

POSITIVE = integer(1)
NON_NEGATIVE = integer(0)
FRACTION = number(0, 1, hi_open=True)

TABLE: dict[str, Spec] = {
    # --- top level (conf/config.yaml)
    "seed": integer(0, 2**32 - 1).note("seeds every rank alike; numpy's range"),
    "check_memory": BOOL,
    "find_batch_size.max_memory_gb": (number(0, lo_open=True) | NULL).note("GiB per rank"),
    "find_batch_size.steps": POSITIVE.note("optimizer steps per try"),
    "find_batch_size.max_micro_batch": POSITIVE,
    "find_batch_size.timeout_s": number(0, lo_open=True).note("seconds per try"),
    "estimate.device_memory": (number(0, lo_open=True) | NULL).note("per rank, in estimate.unit"),
    "estimate.unit": choice("GiB", "GB"),
    "estimate.params": number(1).note("a parameter count, e.g. 7.5e9"),
    "estimate.device": choice("cuda", "cpu"),
    # --- trainer (lightning.pytorch.Trainer; conf/trainer/default.yaml)
    "trainer.accelerator": choice(*_accelerators()),
    "trainer.devices": Spec((POSITIVE | exactly(-1) | exactly("auto") | exactly("-1") | int_list(0)).test,
                            "an integer >= 1, -1 or auto (processes per node), or a list of device ids"),
    "trainer.num_nodes": POSITIVE,
    # 0 is a run that sets up and stops (benchmarks/bench_setup_memory.py measures setup that way)
    "trainer.max_steps": (exactly(-1) | NON_NEGATIVE).note("optimizer steps; -1: no limit"),
    "trainer.max_epochs": (exactly(-1) | NON_NEGATIVE | NULL).note("-1: no limit"),
    "trainer.min_steps": NON_NEGATIVE | NULL,
    "trainer.min_epochs": NON_NEGATIVE | NULL,
    "trainer.accumulate_grad_batches": POSITIVE,
    "trainer.gradient_clip_val": (number(0) | NULL).note("0 or null: no clipping"),
    "trainer.gradient_clip_algorithm": choice("norm", "value") | NULL,
    "trainer.log_every_n_steps": POSITIVE,
    "trainer.val_check_interval": (POSITIVE | number(0, 1, lo_open=True) | NULL).note(
        "training batches, or a fraction of an epoch"),
    "trainer.check_val_every_n_epoch": POSITIVE | NULL,
    "trainer.limit_train_batches": (POSITIVE | number(0, 1, lo_open=True) | NULL).note("batches, or a fraction"),
    "trainer.limit_val_batches": (NON_NEGATIVE | number(0, 1) | NULL).note("batches, or a fraction; 0: no validation"),
    "trainer.num_sanity_val_steps": (integer(-1) | NULL).note("-1: all"),
    "trainer.enable_checkpointing": BOOL | NULL,
    "trainer.use_distributed_sampler": BOOL,
    "trainer.enable_model_summary": BOOL | NULL,
    "trainer.enable_progress_bar": BOOL | NULL,
    "trainer.sync_batchnorm": BOOL,
    "trainer.benchmark": BOOL | NULL,
    "trainer.deterministic": BOOL | exactly("warn") | NULL,
    "trainer.detect_anomaly": BOOL,
    "trainer.fast_dev_run": BOOL | NON_NEGATIVE,
    # --- data (lightning_par.data; conf/data/*.yaml)
    "data.global_batch_size": POSITIVE.note("samples per optimizer step over all data-parallel ranks"),
    "data.seed": NON_NEGATIVE,
    "data.shuffle": BOOL,
    "data.num_workers": NON_NEGATIVE.note("loader processes per rank"),
    "data.pin_memory": BOOL | NULL,
    "data.persistent_workers": BOOL | NULL,
    "data.prefetch_factor": (POSITIVE | NULL).note("batches per worker; null: torch's 2"),
    "data.seq_len": POSITIVE.note("tokens per sample"),
    "data.max_bytes": POSITIVE.note("bytes of text read"),
    "data.val_fraction": FRACTION.note("share of the corpus held out"),
    "data.batch_docs": POSITIVE.note("documents tokenized per call (data=hf_dataset)"),
    "data.n_samples": POSITIVE,
    "data.vocab_size": POSITIVE,
    "data.in_dim": POSITIVE,
    "data.n_classes": POSITIVE,
    "data.channels": POSITIVE,
    "data.image_size": POSITIVE,
    # --- model: the optimizer (every lightning_par model, models/module.py)
    "model.lr": number(0, lo_open=True).note("the learning rate"),
    "model.float8": (exactly(False, "false") | choice("tensorwise", "rowwise")).note(
        "float8 matmuls in the linear layers (torchao; emulated on CPU)"),
    "model.chunked_loss": (exactly(False, "false") | exactly(True, "true") | POSITIVE).note(
        "the output layer and cross-entropy a chunk of tokens at a time (true: 1024 tokens)"),
    "model.lora.rank": NON_NEGATIVE.note("LoRA's rank (0: full fine-tuning)"),
    "model.lora.alpha": number(0, lo_open=True).note("LoRA's scale numerator (update x alpha / rank)"),
    "model.lora.targets": (exactly("default") | Spec(lambda v: isinstance(v, (list, tuple, ListConfig)) and len(v) > 0
                                                      and all(isinstance(t, str) for t in v),
                                                      "a non-empty list of layer names")).note(
        "the linears to adapt (last path component or a pattern)"),
    "model.lora.dropout": FRACTION,
    "model.lora.base": choice("none", "nf4").note("the frozen base's storage (nf4: QLoRA)"),
    "model.lora.train": Spec(lambda v: isinstance(v, (list, tuple, ListConfig)) and all(isinstance(t, str) for t in v),
                             "a list of module names").note("modules trained whole beside the adapters"),
    "model.weight_decay": number(0),
    "model.betas": number_list(2, 0, 1, hi_open=True).note("Adam's beta1, beta2"),
    "model.momentum": number(0, 1, hi_open=True).note("SGD's"),
    # GPT and MoE decoders (models/gpt.py GPTConfig, models/moe.py MoEConfig; presets plus overrides)
    "model.seq_len": (POSITIVE | NULL).note("null: the model's block_size"),
    "model.vocab_size": POSITIVE,
    "model.block_size": POSITIVE,
    "model.n_layer": POSITIVE,
    "model.n_head": POSITIVE,
    "model.n_embd": POSITIVE,
    "model.mlp_ratio": POSITIVE,
    "model.dropout": FRACTION,
    "model.bias": BOOL,
    "model.n_experts": POSITIVE,
    "model.top_k": POSITIVE.note("experts per token, at most n_experts"),
    "model.moe_every": POSITIVE,
    "model.expert_hidden": POSITIVE | NULL,
    "model.shared_expert": BOOL,
    "model.capacity_factor": (number(0, lo_open=True) | NULL).note("null: dropless"),
    "model.aux_loss_coef": number(0),
    "model.z_loss_coef": number(0),
    # Hugging Face causal LMs (models/hf/causal_lm.py)
    "model.hidden": POSITIVE,
    "model.layers": POSITIVE,
    "model.heads": POSITIVE,
    "model.kv_heads": (POSITIVE | NULL).note("null: = heads"),
    "model.intermediate": (POSITIVE | NULL).note("null: the architecture's default"),
    "model.vocab": integer(256).note("the text data is byte-level"),
    "model.max_positions": POSITIVE,
    "model.tie_word_embeddings": BOOL,
    # MLP and CNN (models/mlp.py, models/cnn.py)
    "model.in_dim": POSITIVE,
    "model.depth": POSITIVE,
    "model.n_classes": POSITIVE,
    "model.in_channels": POSITIVE,
    "model.channels": int_list(1).note("output channels per conv block"),
    "model.image_size": POSITIVE,
    # --- scheduler (no _target_: optim.ScheduleConfig; conf/scheduler/*.yaml)
    "scheduler.warmup_steps": NON_NEGATIVE.note("0: no warm-up"),
    "scheduler.warmup_ratio": FRACTION.note("warm-up share of the steps when warmup_steps is 0"),
    "scheduler.min_lr_ratio": number(0, 1).note("final LR / model.lr"),
    "scheduler.total_steps": (POSITIVE | NULL).note("null: trainer.max_steps"),
    "scheduler.base_batch_size": (POSITIVE | NULL).note("the global batch model.lr was tuned for"),
    # --- strategy (lightning_par.strategies; conf/strategy/*.yaml). pp, tp, ep, data_parallel, schedule,
    # balance, param_dtype, reduce_dtype, prefetch: their constructors / FSDPOptions.check (CHECKED_ELSEWHERE)
    "strategy.device": (exactly("auto") | Spec(_torch_device, "a torch device such as cpu or cuda:0")),
    "strategy.n_microbatches": (POSITIVE | NULL).note("per batch; null: one per pipeline rank"),
    "strategy.virtual_stages": (POSITIVE | NULL).note("stages per rank; null: by schedule"),
    "strategy.replicate": POSITIVE.note("HSDP replica groups; 1: plain FSDP"),
    "strategy.grad_sync": choice("every_micro_batch", "last_micro_batch"),
    "strategy.collectives": choice("auto", "reduce_scatter", "all_reduce"),
    "strategy.bucket_cap_mb": number(0, lo_open=True).note("MB per gradient bucket"),
    "strategy.reshard_after_forward": BOOL | NULL,
    "strategy.cpu_offload": BOOL,
    "strategy.offload_chunk_mb": number(0, lo_open=True).note("disk tier: parameter MB per chunk of the optimizer step"),
    "strategy.activation_checkpointing": (BOOL | choice("full", "selective") | integer(1)).note(
        "true = full: each block recomputed; selective: matmul outputs kept, the rest recomputed; k: every k-th block"),
    "strategy.sync_batchnorm": BOOL,
    "strategy.gradient_as_bucket_view": BOOL,
    "strategy.static_graph": BOOL,
    "strategy.find_unused_parameters": BOOL,
    "strategy.sequence_parallel": BOOL,
    "strategy.loss_parallel": BOOL,
    "strategy.process_group_backend": (Spec(_backends, "a torch.distributed backend (gloo, nccl, ...)") | NULL),
    # --- callbacks (conf/callbacks/*.yaml)
    "callbacks.checkpoint.every_n_train_steps": (POSITIVE | NULL).note("optimizer steps between checkpoints"),
    "callbacks.checkpoint.every_n_epochs": NON_NEGATIVE | NULL,
    "callbacks.checkpoint.save_top_k": integer(-1).note("-1: keep every one"),
    "callbacks.checkpoint.save_last": BOOL | exactly("link") | NULL,
    "callbacks.checkpoint.auto_insert_metric_name": BOOL,
    "callbacks.checkpoint.at_end": BOOL.note("also a checkpoint at the last step"),
    "callbacks.throughput.warmup_steps": NON_NEGATIVE.note("steps left out of the timing"),
    "callbacks.throughput.every_n_steps": (POSITIVE | NULL).note("null: 10"),
    "callbacks.throughput.peak_tflops": (number(0, lo_open=True) | NULL).note("null: the device table"),
    "callbacks.memory.measure_at_step": NON_NEGATIVE,
    "callbacks.guard.check_every_n_steps": POSITIVE,
    "callbacks.moe.flush_every_n_steps": POSITIVE,
    "callbacks.export.at_end": BOOL,
    "callbacks.export.dtype": choice("keep", "bf16", "fp16", "fp32"),
    "callbacks.comm.warmup_steps": NON_NEGATIVE,
    "callbacks.comm.measure_steps": POSITIVE.note("steps counted after the warm-up"),
    # --- loggers (conf/logger/*.yaml)
    "logger.wandb.offline": BOOL,
    "logger.wandb.log_model": BOOL | exactly("all"),
}

#: what ``mode`` may be: the app's jobs (``cli._run`` runs the one named)
MODES = ("train", "estimate", "find_batch_size")


def _checkers() -> dict[str, tuple[Callable[..., Any], ...]]:
    """Key -> the callables (functions, classes, methods) that check its value, in one line naming the key,
    where the code reads it -- not in ``TABLE``. References, not names: a checker renamed or moved breaks
    this import (tests/test_config_values.py reads every entry)."""
    from lightning_par.callbacks.guard import RunGuard
    from lightning_par.data import TextDataModule, TokenFileDataModule
    from lightning_par.data.hf_dataset import HFDatasetModule
    from lightning_par.strategies.checkpoint.export import size_bytes
    from lightning_par.models import GPTModule
    from lightning_par.models.attention import check_name
    from lightning_par.models.gpt import GPTConfig
    from lightning_par.run.attention_option import check_attention
    from lightning_par.models.hf.causal_lm import HFCausalLM, hf_config
    from lightning_par.models.moe import MoEConfig
    from lightning_par.models.moe_module import MoEModule
    from lightning_par.models.hf.pretrained import pretrained_config
    from lightning_par.core.optim import OptimizerConfig, ScheduleConfig
    from lightning_par.parallel.sharding.disk_offload import check_offload_dir
    from lightning_par.parallel.sharding.fsdp import resolve_units
    from lightning_par.parallel.pipeline.stages import resolve_split_points
    from lightning_par.parallel.memory.tiling import check_tiling, with_tied_partners
    from lightning_par.strategies.base import compile_fields
    from lightning_par.strategies.checkpoint.dcp import check_checkpoint
    from lightning_par.strategies.composite import MeshParallelStrategy
    from lightning_par.strategies.expert_parallel import ExpertParallelStrategy
    from lightning_par.strategies.fsdp_options import FSDPOptions
    from lightning_par.strategies.zero import Zero3OffloadStrategy
    from lightning_par.run.train import check_writable, validate

    mesh = (MeshParallelStrategy.__init__,)  # a positive integer or null; its own lists of names
    return {
        "compile": (compile_fields,),
        "ckpt_path": (check_checkpoint,),  # names the file
        "trainer.precision": (validate,),  # Lightning's precision names
        "data.files": (TextDataModule,),  # a glob that matches nothing, an unreadable or empty file: names it
        "data.tokenizer": (HFDatasetModule,),  # loads it: names the directory
        "data.field": (HFDatasetModule,),  # the dataset's columns
        "data.split": (HFDatasetModule,),  # the dataset's splits
        "data.path": (TokenFileDataModule, HFDatasetModule),  # names the file: glob, header, size, corpus length
        "model.optimizer": (OptimizerConfig,),  # OPTIMIZERS
        "model.preset": (GPTModule, MoEModule),  # their PRESETS
        "model.gating": (MoEConfig,),  # GATINGS
        "model.arch": (hf_config,),  # ARCHS
        # models/attention.NAMES, for our GPT / MoE (GPTConfig) and Hugging Face models (hf_config); the device
        # (CPU: no sdpa_efficient / sdpa_cudnn; CUDA capability) by run/attention_option.check_attention
        "model.attn_implementation": (check_name, GPTConfig, hf_config, check_attention),
        "model.pretrained": (pretrained_config,),  # the directory and its tensors, against its config
        "model.config.**": (HFCausalLM,),  # free-form fields of transformers' own config
        "scheduler.name": (ScheduleConfig,),  # SCHEDULES
        "scheduler.lr_scaling": (ScheduleConfig,),  # LR_SCALING
        "strategy.pp": mesh,
        "strategy.tp": mesh,
        "strategy.ep": (MeshParallelStrategy.__init__, ExpertParallelStrategy.__init__),  # a positive integer
        "strategy.data_parallel": mesh,  # DATA_PARALLEL
        "strategy.schedule": mesh,  # parallel.pipeline.SCHEDULES
        "strategy.balance": mesh,  # BALANCE
        "strategy.param_dtype": (FSDPOptions.check,),  # lightning_par/core/dtypes.py
        "strategy.reduce_dtype": (FSDPOptions.check,),  # lightning_par/core/dtypes.py
        "strategy.prefetch": (FSDPOptions.check,),  # an integer >= 0
        "strategy.units": (resolve_units,),  # blocks, a class name, a size or paths
        "strategy.split_points": (resolve_split_points,),  # paths or indices of the model's layers
        "strategy.tiling": (check_tiling, with_tied_partners),  # module path: tiles >= 2, against the meta model
        "callbacks.guard.nonfinite": (RunGuard,),  # NONFINITE_ACTIONS
        "callbacks.checkpoint.dirpath": (check_writable,),
        "strategy.offload_dir": (Zero3OffloadStrategy.validate_setup, check_offload_dir),  # created, writable, room
        "callbacks.export.max_shard_size": (size_bytes,),  # 5GB, 500MB, bytes
    }


class _Checkers(Mapping):
    """``_checkers()``, imported when first read (importing this module stays light: the app checks a config
    for ``mode=estimate`` too, which builds no strategy or model)."""

    def __init__(self) -> None:
        self._table: dict[str, tuple[Callable[..., Any], ...]] | None = None

    def _get(self) -> dict[str, tuple[Callable[..., Any], ...]]:
        if self._table is None:
            self._table = _checkers()
        return self._table

    def __getitem__(self, key: str) -> tuple[Callable[..., Any], ...]:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


#: keys whose value is checked, in one line naming the key, by the code that reads it -- not here: key -> the
#: callables that check it (``mode``: ``check_config_values`` itself, against ``MODES``)
CHECKED_ELSEWHERE: Mapping[str, tuple[Callable[..., Any], ...]] = _Checkers()

#: keys without a type or range to check (free text, paths checked by use, Hydra plumbing); ``*``: any one
#: part of the key, ``**``: any number of parts
NOT_CHECKED: tuple[str, ...] = (
    "**._target_", "paths.**", "logger.**", "trainer.default_root_dir", "callbacks.checkpoint.filename",
    "callbacks.summary.**", "callbacks.bubble.output_dir", "callbacks.export.output_dir",
)


# ---------------------------------------------------------------------------------------------------
# the check


def check_config_values(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` (one line: ``<key>=<value as given>: expected ...``) for the first value in
    ``cfg`` that ``TABLE`` refuses; plain values first, then interpolated ones. A value the yaml leaves
    for the user (``???``, e.g. ``data.path`` of ``data=tokens``) and that is still unset comes first."""
    for key in _missing(cfg):
        raise ConfigError(f"{key} needs a value: add {key}=... to the command line")
    given = _given_values()
    later = []
    for key, spec in TABLE.items():
        found = _lookup(cfg, key)
        if found is None:
            continue
        interpolated, value = found
        if interpolated:
            later.append((key, spec, value))
        elif not spec.test(value):
            _refuse(key, spec, value, given)
    for key, spec, value in later:
        if not spec.test(value):
            _refuse(key, spec, value, given)
    mode = cfg.get("mode", "train")
    if mode not in MODES:  # the app's own words for it since before the table
        raise ConfigError(f"unknown mode {mode!r}; choose from: {', '.join(MODES)}")


def _missing(cfg: DictConfig) -> list[str]:
    """Keys still ``???`` outside Hydra's own node (whose run-time values are unset before a job runs),
    found without resolving any interpolation."""
    out = []

    def walk(node: Any, prefix: str) -> None:
        for key in node.keys():
            child = node._get_node(key)
            path = f"{prefix}{key}"
            if path == "hydra":
                continue
            if isinstance(child, (DictConfig, ListConfig)) and not child._is_missing() and not child._is_none() \
                    and not child._is_interpolation():
                walk(child, path + ".") if isinstance(child, DictConfig) else None
            elif child is not None and child._is_missing():
                out.append(path)

    walk(cfg, "")
    return out


def _refuse(key: str, spec: Spec, value: Any, given: dict[str, str]) -> None:
    raise ConfigError(f"{key}={echo(given[key] if key in given else _format(value))}: expected {spec.expected}")


def _lookup(cfg: DictConfig, key: str) -> tuple[bool, Any] | None:
    """(is an interpolation, the resolved plain value) of ``key``; None where the key is absent, its
    node is built from a class of the user's own, or it cannot be resolved (not this table's business)."""
    parent_key, _, leaf = key.rpartition(".")
    try:
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    except Exception:  # noqa: BLE001 -- an interpolation above the key that does not resolve
        return None
    if not isinstance(parent, DictConfig) or leaf not in parent or not _ours(parent):
        return None
    try:
        interpolated = OmegaConf.is_interpolation(parent, leaf)
        value = parent[leaf]
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
    except Exception:  # noqa: BLE001 -- e.g. ${hydra:...} outside a Hydra run
        return None
    return interpolated, value


def _ours(node: DictConfig) -> bool:
    """Whether the table speaks for ``node``'s keys: no ``_target_``, or lightning_par's / Lightning's class."""
    target = node.get("_target_") if "_target_" in node else None
    return target is None or str(target).startswith(("lightning_par.", "lightning.", "pytorch_lightning."))


def _given_values() -> dict[str, str]:
    """``key -> value text`` of this run's command-line overrides (Hydra's ``overrides.task``), if any."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return {}
        task = list(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001 -- no Hydra run (a child rank reads a saved config)
        return {}
    out = {}
    for item in task:
        key, sep, text = str(item).lstrip("+~").partition("=")
        if sep:
            out[key.strip()] = text
    return out


def _format(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    return repr(value) if isinstance(value, float) else str(value)


def echo(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` as one printable line of at most ``limit`` characters: control, format and separator
    characters (newlines, tabs, right-to-left marks, ...) escaped, the rest cut off with ``...``."""
    printable = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return printable if len(printable) <= limit else printable[: limit - 3] + "..."


def leaf_keys(cfg: DictConfig) -> Iterator[str]:
    """Every leaf key of ``cfg`` (dotted; a list is one leaf; ``hydra`` left out), for the coverage test."""

    def walk(node: Any, prefix: str) -> Iterator[str]:
        if isinstance(node, dict):
            for k, v in node.items():
                yield from walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            yield prefix

    data = OmegaConf.to_container(cfg, resolve=False)
    data.pop("hydra", None)
    yield from walk(data, "")


def matches(key: str, pattern: str) -> bool:
    """``pattern`` over a dotted key: ``*`` stands for one part, ``**`` for any number of parts (none too)."""

    def match(parts: list[str], want: list[str]) -> bool:
        if not want:
            return not parts
        if want[0] == "**":
            return any(match(parts[i:], want[1:]) for i in range(len(parts) + 1))
        return bool(parts) and want[0] in ("*", parts[0]) and match(parts[1:], want[1:])

    return match(key.split("."), pattern.split("."))


def coverage(key: str) -> str | None:
    """Where ``key`` is checked: ``"table"`` (``mode`` too: ``MODES``), ``"elsewhere"``, ``"not checked"``; None:
    nowhere yet."""
    for where, patterns in (("table", (*TABLE, "mode")), ("elsewhere", CHECKED_ELSEWHERE),
                            ("not checked", NOT_CHECKED)):
        if any(matches(key, p) for p in patterns):
            return where
    return None
