"""``mode=estimate`` and ``python -m lightning_par.modes.estimate``: the memory model
(``lightning_par/costs/estimate.py``) asked about a run's config or a command line. App code: it reads
config nodes and builds the configured strategy; the cost model below it takes plain arguments."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from typing import Any

from lightning_par.costs.traced import trace_model
from lightning_par.core.dtypes import canonical_precision
from lightning_par.costs.estimate import (OPTIMIZERS, PRECISIONS, STRATEGIES, MemoryEstimate, estimate, estimate_table,
                                    estimate_traced, model_shape, preset_names, strategy_layout)
from lightning_par.strategies.catalog import CATALOG, entry_of


def run_estimate(cfg: Any) -> str:
    """``python run.py mode=estimate ...``: the table for the run's config, and ``estimate.json``.

    Rows: the data-parallel family at N ranks and, when the configured strategy is another, that
    strategy with its own mesh (``dims_for``). N, the per-rank micro-batch and the mesh come from
    ``lightning_par.run.facts`` (as training computes them); the model's shape from the module the model
    config builds. Optional keys: ``+estimate.device_memory=80`` (a fits column, in ``unit``),
    ``+estimate.unit=GB``, ``+estimate.params=7.5e9`` (a bare count instead of the model),
    ``+estimate.device=cpu`` (default: cuda unless ``trainer.accelerator=cpu``), ``+estimate.method``:
    ``auto`` (default: the cost model's shape of the model where it has one -- our GPT and MoE, a Hugging
    Face decoder of a family it prices, as the advisor prices them, so the two answer a question alike --
    else one training step traced on fake tensors), ``shape`` or ``trace`` (a Hugging Face model's step
    traced op by op, its own attention and MLP kernels included).
    Writes ``<run dir>/estimate.json`` (bytes). Raises ``ConfigError`` (one line) for bad input.
    """
    from lightning_par import ConfigError
    from lightning_par.run import facts

    opts = cfg.get("estimate") or {}
    try:
        n = facts.world_size(cfg)
        precision = str(cfg.trainer.get("precision", "32-true"))
        precision = canonical_precision(precision)  # Lightning's short forms: bf16 -> bf16-mixed
        optimizer = str(cfg.model.get("optimizer", "adamw"))
        device = str(opts.get("device") or ("cpu" if str(cfg.trainer.get("accelerator")) == "cpu" else "cuda"))
        strategy, tiling = facts.strategy_of(cfg.strategy)
        found = entry_of(strategy)
        if found is None:
            raise ValueError(f"the estimator has no model for strategy {type(strategy).__name__} (not in the "
                             "strategy catalogue, lightning_par/strategies/catalog.py)")
        name = found.name
        dims = facts.mesh_of(strategy, n)
        gbs = int(cfg.data.get("global_batch_size", n))
        micro = facts.micro_batch_size(gbs, dims.dp, int(cfg.trainer.get("accumulate_grad_batches", 1)))
        checkpointing = strategy.cost_options().recompute
        params = opts.get("params")
        method = str(opts.get("method", "auto"))
        if method not in ("auto", "shape", "trace"):
            raise ValueError(f"estimate.method={method!r}; choose from: auto, shape, trace")
        shape = None if params is not None else facts.gpt_shape(cfg.model, cfg.data.get("seq_len"))
        if shape is None and params is None and method != "trace":
            shape = _declared_shape(cfg.model, cfg.data.get("seq_len"), required=method == "shape")
        # a model the estimator has no op-by-op shape for (Hugging Face, a user's module): one training
        # step traced on fake tensors per micro-batch size, when the module declares the contract
        traces: dict[int, Any] = {}
        module = _module(cfg.model) if shape is None and params is None else None
        model: Any = int(float(params)) if params is not None else (shape or _count(module))
        accumulate = int(cfg.trainer.get("accumulate_grad_batches", 1))
        kw = dict(devices=n, precision=precision, optimizer=optimizer, checkpointing=checkpointing, device=device)
        rows, notes = [], []

        def row_estimate(row: str, row_micro: int, lay: Any = None) -> MemoryEstimate:
            if module is not None:
                try:
                    if row_micro not in traces:
                        traces[row_micro] = trace_model(lambda: _module(cfg.model), row_micro, precision=precision)
                    return estimate_traced(traces[row_micro], devices=1 if row == "single" else n, strategy=row,
                                           layout_=lay)
                except ValueError as exc:  # no contract to trace, or a layout that splits the model
                    notes.append(f"note: {row}: activations not estimated ({exc})")
            return estimate(model, strategy=row, micro_batch_size=row_micro, layout_=lay, **kw)

        family = [s for s in STRATEGIES if s != name] if n > 1 else []
        for row in family:  # the data-parallel family: dp = N (single: one device)
            dp = 1 if row == "single" else n
            row_micro = max(1, gbs // (dp * accumulate))
            if gbs % (dp * accumulate):
                notes = [f"note: data.global_batch_size={gbs} does not split over {dp} ranks x {accumulate}; the "
                         f"data-parallel rows assume a micro-batch of {row_micro}"]
            rows.append(replace(row_estimate(row, row_micro), micro_batch_size=row_micro))
        rows.append(replace(row_estimate(name, micro, strategy_layout(name, strategy, dims, tiling, accumulate)),
                            micro_batch_size=micro))
        rows.sort(key=lambda r: [e.name for e in CATALOG].index(r.strategy))
        n_params = model if isinstance(model, int) else model.units()["total"]
        comm = [_row_comm(r, strategy if r.strategy == name else None, n_params, shape, precision, accumulate)
                for r in rows]
        table = "\n".join(notes + [estimate_table(model, rows=rows, device_memory=opts.get("device_memory"),
                                                   unit=str(opts.get("unit", "GiB")), micro_batch_size=micro,
                                                   traced=bool(traces), **kw)])
    except (ValueError, KeyError) as e:
        raise ConfigError(str(e).strip("'\"")) from None
    out_dir = str(cfg.paths.output_dir)
    os.makedirs(out_dir, exist_ok=True)
    record = {"world_size": n, "strategy": name, "mesh": dims.sizes(), "precision": precision,
              "optimizer": optimizer, "micro_batch_size": micro, "checkpointing": checkpointing, "device": device, "seq_len": shape.seq_len if shape else None,
              "n_params": model if isinstance(model, int) else model.units()["total"],
              "strategies": [{**r.as_dict(), "comm": c} for r, c in zip(rows, comm)]}
    with open(os.path.join(out_dir, "estimate.json"), "w") as f:
        json.dump(record, f, indent=2)
    print(table)
    return table


def _row_comm(row: MemoryEstimate, strategy: Any, n_params: int, shape: Any, precision: str,
              accumulate: int) -> dict[str, dict[str, int]] | None:
    """A row's predicted bytes per step and rank (``costs/comm.py``), keyed as summary.json's ``comm``:
    the configured strategy's with its own options, a family row's with the defaults; None where the
    comm model does not cover it. ``shape``: the model's (``costs/shape.Shape``, at the sequence it
    trains on), or None."""
    from lightning_par.costs.comm import CommShape, step_comm_bytes
    from lightning_par.costs.run_prediction import strategy_comm
    from lightning_par.costs.states import bytes_per_param

    micro = row.micro_batch_size or 1
    try:
        if strategy is not None:
            return strategy_comm(strategy, mesh=row.mesh, n_params=n_params, shape=shape,
                                 batch=(micro, shape.seq_len) if shape is not None else None,
                                 precision=precision, accumulate=accumulate)
        return step_comm_bytes(row.strategy, n_params=n_params, mesh=row.mesh,
                               dtype_bytes=int(bytes_per_param(precision, "adamw")[1]),
                               shape=CommShape(shape=shape, micro_batch=micro) if shape is not None else None,
                               accumulate=accumulate)
    except ValueError:
        return None


def _declared_shape(model_cfg: Any, seq_len: int | None, required: bool) -> Any:
    """The cost model's ``Shape`` the model ``model_cfg`` builds declares (``cost_shape``, read by
    ``Shape.of_model``: a Hugging Face decoder's through ``Shape.of_hf``, what the advisor prices), or
    None: a model that declares none, or of a family the cost model has no shape for (ValueError then,
    one line, when ``required``)."""
    from lightning_par.costs.shape import Shape

    module = _module(model_cfg)
    try:
        shape = Shape.of_model(module, int(seq_len) if seq_len else None)
    except ValueError:
        if required:
            raise
        return None
    if shape is None and required:
        raise ValueError("estimate.method=shape: the cost model has no shape for "
                         f"{type(module).__name__}; use estimate.method=trace")
    return shape


def _module(model_cfg: Any) -> Any:
    """A fresh, unbuilt instance of the configured model (each trace builds its own)."""
    from lightning_par.models.build import instantiate_model

    return instantiate_model(model_cfg)


def _count(module: Any) -> int:
    """Parameters of ``module``, built on the meta device."""
    import torch

    with torch.device("meta"):
        module.configure_model()
    return sum(p.numel() for p in module.parameters())


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(prog="python -m lightning_par.modes.estimate",
                                 description="Memory per rank of every strategy (lightning_par/costs/estimate.py)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="PRESET",
                     help="a model of conf/model: " + ", ".join(preset_names()) + " (the GPT and MoE presets, "
                          "then the Hugging Face decoders)")
    src.add_argument("--params", type=float, help="parameter count, e.g. 7.5e9 (no activations)")
    ap.add_argument("--devices", type=int, default=1, help="data-parallel size N")
    ap.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    ap.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=None, help="default: the preset's block_size (max_positions)")
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
