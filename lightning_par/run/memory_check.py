"""The memory check before launch: the estimator's predicted peak per rank against what the machine
has, so a run that cannot fit stops in one line instead of being killed by the kernel minutes later.

Available per rank: on CUDA the device's total memory; on CPU the host's available memory
(``MemAvailable``) divided by the ranks this node starts, less what each rank's runtime takes before
any tensor exists (Python, torch, Lightning: this process's resident size, the batch-size finder's
baseline). Predicted: ``mode=estimate``'s row for the configured strategy: ``costs/peak.py`` for the
models whose shape the estimator knows (the GPT and MoE presets), a training step traced on fake
tensors (``costs/traced.py``) for the others (Hugging Face, a user's module, the MLP and CNN
classifiers) under the data-parallel strategies. Where no prediction can be made -- a model split by
tp/pp/ep that the estimator has no shape for, one the tracer cannot run, a strategy outside the
catalogue, a layout the estimator does not price -- the run goes on and one line says so
(``note: memory check skipped: <why>``), printed once where the run is launched; never silence.
``check_memory=false`` skips it (no note).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from lightning_par import ConfigError
from lightning_par.parallel.memory.checkpointing import checkpointing_mode
from lightning_par.run import facts

log = logging.getLogger(__name__)

GIB = 2**30


def available_per_rank(on_cuda: bool, ranks_here: int) -> tuple[int, str]:
    """(bytes, how they were found) one rank may use."""
    if on_cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        return total, f"{total / GIB:.1f} GiB of device memory"
    from lightning_par.callbacks.memory import peak_rss_bytes

    available = _mem_available()
    runtime = peak_rss_bytes()
    per_rank = available // max(1, ranks_here) - runtime
    return per_rank, (f"{available / GIB:.1f} GiB of available host memory / {ranks_here} rank(s), less "
                      f"{runtime / GIB:.2f} GiB of runtime per rank")


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def predicted_peak(cfg: Any, strategy: Any, model: Any, world: int) -> tuple[int, str] | None:
    """(bytes, strategy name) of the configured run's predicted peak per rank, or None where the
    estimator has no model of it (``prediction`` says why)."""
    found = prediction(cfg, strategy, model, world)
    return None if isinstance(found, str) else found


def prediction(cfg: Any, strategy: Any, model: Any, world: int) -> tuple[int, str] | str:
    """(bytes, strategy name) of the configured run's predicted peak per rank, or why there is none (one
    line: a model of unknown shape under a layout that splits it, a strategy outside the catalogue, ...)."""
    from lightning_par.costs.activations import Shape
    from lightning_par.core.dtypes import canonical_precision
    from lightning_par.costs.estimate import estimate, strategy_layout
    from lightning_par.strategies.catalog import entry_of

    config, found = getattr(model, "config", None), entry_of(strategy)
    if found is None:
        return (f"strategy {type(strategy).__name__} is not one of lightning_par's catalogued strategies, whose "
                "memory mode=estimate prices")
    dims = facts.mesh_of(strategy, world)
    accumulate = int(cfg.trainer.get("accumulate_grad_batches", 1))
    micro = facts.micro_batch_size(int(cfg.data.get("global_batch_size", world)), dims.dp, accumulate)
    precision = canonical_precision(str(cfg.trainer.get("precision", "32-true")))
    tiling = dict(getattr(strategy, "tiling", None) or {})
    if not all(hasattr(config, k) for k in ("n_layer", "n_embd", "n_head", "vocab_size")):
        return _traced_peak(cfg, found.name, strategy, dims, micro, precision, tiling, accumulate, model)
    if getattr(model, "lora", None) is not None:  # the adapters' shape (Shape.of_model reads module.lora); None: an
        shape = Shape.of_model(model, getattr(model, "seq_len", None))  # MoE with LoRA, not priced op by op: traced
        if shape is None:
            return _traced_peak(cfg, found.name, strategy, dims, micro, precision, tiling, accumulate, model)
    else:
        shape = Shape.of(config, getattr(model, "seq_len", None))
    on_cuda = _on_cuda(cfg)
    try:
        lay = strategy_layout(found.name, strategy, dims, tiling, accumulate)
    except Exception as e:  # noqa: BLE001 - the check never stops a run it cannot price: it says so
        return f"mode=estimate does not price strategy={found.name} here ({_what_failed(e)})"
    try:
        est = estimate(shape, devices=dims.world_size, strategy=found.name, precision=precision,
                       optimizer=str(cfg.model.get("optimizer", "adamw")), micro_batch_size=micro,
                       checkpointing=checkpointing_mode(getattr(strategy, "activation_checkpointing", False)) or False,
                       device="cuda" if on_cuda else "cpu", layout_=lay)
    except ValueError as e:  # a layout the estimator does not price: nothing to check against
        return f"mode=estimate does not price strategy={found.name} here ({_first_line(e)})"
    return est.peak, found.name


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0][:200] if text else type(exc).__name__)


def _what_failed(exc: BaseException) -> str:
    """``Type: first line`` of an exception (its type alone when it says nothing)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def _traced_peak(cfg: Any, name: str, strategy: Any, dims: Any, micro: int, precision: str, tiling: dict,
                 accumulate: int, model: Any = None) -> tuple[int, str] | str:
    """A model without a GPT shape (Hugging Face, a user's module, the MLP, the CNN): one training step
    traced on fake tensors (``costs/traced.py``, CPU kernels: on CUDA an upper bound for attention),
    re-held as a data-parallel strategy holds it. Why not, where the strategy splits the model (tp, pp,
    ep: asked first, before tracing) or the step cannot be traced."""
    from lightning_par.models.build import instantiate_model

    from lightning_par.costs.traced import trace_model
    from lightning_par.costs.estimate import estimate_traced, strategy_layout

    what = type(model).__name__ if model is not None else str(cfg.model.get("_target_", "the model")).rsplit(".")[-1]
    try:
        lay = strategy_layout(name, strategy, dims, tiling, accumulate)
    except Exception as e:  # noqa: BLE001 - the check never stops a run it cannot price: it says so
        return f"mode=estimate does not price strategy={name} here ({_what_failed(e)})"
    if lay.tp > 1 or lay.pp > 1 or lay.ep > 1:
        return (f"strategy={name} splits {what} (tp={lay.tp}, pp={lay.pp}, ep={lay.ep}), and a model without a GPT "
                "shape is priced from one traced step under data-parallel strategies only")
    try:
        traced = trace_model(lambda: instantiate_model(cfg.model), micro, precision=precision)
        est = estimate_traced(traced, devices=dims.world_size, strategy=name, layout_=lay)
    except Exception as exc:  # noqa: BLE001 - a model the tracer cannot run is not checked, and said so
        return f"one training step of {what} could not be traced ({_what_failed(exc)})"
    return est.peak, name


def _on_cuda(cfg: Any) -> bool:
    acc = str(cfg.trainer.get("accelerator", "auto"))
    return torch.cuda.is_available() and acc in ("auto", "gpu", "cuda")


def check_memory(cfg: Any, strategy: Any, model: Any, world: int) -> None:
    """Raise ``ConfigError`` (one line) when the predicted peak per rank exceeds what a rank has; print one
    note saying why when no peak can be predicted (the run goes on)."""
    if not bool(cfg.get("check_memory", True)):
        return
    predicted = prediction(cfg, strategy, model, world)
    if isinstance(predicted, str):  # the run goes on, and says it was not checked (once: here, at launch)
        print(f"note: memory check skipped: {predicted}")
        return
    peak, name = predicted
    ranks_here = 1 if getattr(strategy, "single_process", False) else world // int(cfg.trainer.get("num_nodes", 1))
    have, how = available_per_rank(_on_cuda(cfg), ranks_here)
    if peak > have:
        raise ConfigError(
            f"strategy={name} on {world} rank(s) is predicted to need {peak / GIB:.2f} GiB per rank at its peak "
            f"(mode=estimate) but a rank has {max(have, 0) / GIB:.2f} GiB ({how}); "
            f"{_advice(cfg, model, world, ranks_here, have)}; check_memory=false runs it anyway")


def _advice(cfg: Any, model: Any, world: int, ranks_here: int, have: int) -> str:
    """The advisor's plan for this machine, as a command (or why there is none)."""
    from lightning_par.costs.advisor import Cluster, advise
    from lightning_par.costs.activations import Shape
    from lightning_par.core.dtypes import canonical_precision

    nodes = max(1, world // max(1, ranks_here))
    if not all(hasattr(getattr(model, "config", None), k) for k in ("n_layer", "n_embd", "n_head", "vocab_size")):
        return ("the advisor plans GPT-shaped models only: mode=estimate prices this one under every data-parallel "
                "strategy (zero3, zero3_offload shard the most)")
    shape = Shape.of(model.config, getattr(model, "seq_len", None))
    try:
        advice = advise(shape, Cluster(nodes, ranks_here, max(have, 0) / GIB),
                        precision=canonical_precision(str(cfg.trainer.get("precision", "32-true"))),
                        optimizer=str(cfg.model.get("optimizer", "adamw")), headroom=1.0,
                        preset=cfg.model.get("preset"))
    except ValueError as e:
        return f"the advisor has no plan ({e})"
    if advice.strategy is None:
        return "no plan the advisor knows fits this machine: add devices, shorten the sequence or the batch"
    return f"the advisor's plan for this machine: {advice.command()}"
