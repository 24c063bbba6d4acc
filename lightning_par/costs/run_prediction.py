"""The comm model asked about the run in progress: ``comm_predicted`` in summary.json, beside the
measured ``comm`` (``callbacks/comm.py``), with the same keys (``{kind: {axis: bytes}}`` per step and
rank, the busiest rank's).

A Lightning callback of the estimates layer: it reads the built strategy (its catalogue entry,
mesh, options), the model's shape where the model declares one (``cost_shape``: ``GPTModule``,
``MoEModule``, ``HFCausalLM`` of a family the cost model prices; ``costs/shape.Shape.of_model``), the
micro-batch and sequence of the first training batch and the trainer's accumulation, and asks
``costs/comm.step_comm_bytes``. Strategies whose traffic depends on activations (tensor and pipeline
parallelism) need the shape; without one the prediction is ``null`` and ``comm_predicted_note`` says why.
"""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_par.core import dtypes
from lightning_par.costs.comm import CommShape, step_comm_bytes
from lightning_par.costs.shape import Shape
from lightning_par.strategies.catalog import entry_of


class CommPrediction(L.Callback):
    def __init__(self) -> None:
        self._batch: tuple[int, int] | None = None
        self.predicted: dict[str, dict[str, int]] | None = None
        self.note: str | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._batch, self.predicted, self.note = None, None, None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        if self._batch is None:
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
            if hasattr(x, "shape") and len(x.shape) >= 2:
                self._batch = (int(x.shape[0]), int(x.shape[1]))

    def finalize(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Called by ``RunSummary`` before it reads ``summary()``."""
        try:
            self.predicted = predict(trainer, pl_module, self._batch)
        except ValueError as e:  # a layout or option the comm model does not cover
            self.predicted, self.note = None, str(e)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"comm_predicted": self.predicted}
        if self.note:
            out["comm_predicted_note"] = self.note
        return out


def model_shape(pl_module: Any, seq: int) -> Shape | None:
    """The shape ``pl_module`` declares (``Shape.of_model``) at sequence length ``seq``; None for a model
    that declares none or one of a family the cost model does not price."""
    try:
        return Shape.of_model(pl_module, seq)
    except ValueError:  # a Hugging Face family without an op-by-op shape: priced as a model without one
        return None


def predict(trainer: L.Trainer, pl_module: L.LightningModule,
            batch: tuple[int, int] | None) -> dict[str, dict[str, int]] | None:
    strategy = trainer.strategy
    if entry_of(strategy) is None:  # a strategy of Lightning's own or a user's: no cost options to read
        raise ValueError(f"{type(strategy).__name__} is not in the strategy catalogue: no comm model")
    facts = strategy.model_facts or {}
    clip = trainer.gradient_clip_val
    return strategy_comm(strategy, mesh=dict(strategy.mesh_sizes),
                         n_params=int(facts.get("n_params", sum(p.numel() for p in pl_module.parameters()))),
                         shape=model_shape(pl_module, batch[1]) if batch else None, batch=batch,
                         precision=str(trainer.precision),
                         accumulate=int(trainer.accumulate_grad_batches), grad_clip=bool(clip and clip > 0),
                         float8=facts.get("float8"))


def strategy_comm(strategy: Any, *, mesh: dict[str, int], n_params: int, shape: Shape | None,
                  batch: tuple[int, int] | None, precision: str, accumulate: int = 1,
                  grad_clip: bool = False, float8: dict[str, Any] | None = None) -> dict[str, dict[str, int]]:
    """``step_comm_bytes`` for a built strategy (its catalogue entry and options) on ``mesh``:
    ``batch`` is (sequences per rank per forward -- a pipeline's whole batch, split into its
    micro-batches --, sequence length); ``shape`` the model's at that sequence length (None: the
    model declares none); ``float8``: what float8 converted (the strategy's ``model_facts["float8"]``), whose
    weights FSDP may all-gather in float8."""
    found = entry_of(strategy)
    if found is None:
        raise ValueError(f"{type(strategy).__name__} is not in the strategy catalogue: no comm model")
    o = strategy.cost_options()
    n_micro = o.microbatches_for(mesh.get("pp", 1))
    comm = CommShape(shape=shape, micro_batch=batch[0] // n_micro) if batch and shape is not None else None
    pr = dtypes.precision(dtypes.canonical_precision(precision))
    gather = dtypes.parse_dtype(o.param_dtype, "param_dtype") if o.param_dtype else pr.param
    return step_comm_bytes(
        found.name, n_params=n_params, mesh=mesh, dtype_bytes=dtypes.dtype_bytes(gather), shape=comm,
        micro_batches=n_micro, reshard_after_forward=o.reshard_after_forward is not False, schedule=o.schedule,
        virtual_stages=o.virtual_stages, sequence_parallel=o.sequence_parallel, loss_parallel=o.loss_parallel,
        grad_clip=grad_clip, expert_params=shape.expert_params() if shape is not None else 0,
        data_parallel=o.data_parallel or "replicate", activation_bytes=dtypes.dtype_bytes(pr.compute),
        recompute=o.recompute, accumulate=accumulate, grad_sync=o.grad_sync,
        reduce_dtype_bytes=(dtypes.dtype_bytes(dtypes.parse_dtype(o.reduce_dtype, "reduce_dtype"))
                            if o.reduce_dtype else None),
        zero2_collectives=o.zero2_collectives,
        **({"float8_params": int(float8["params"]), "float8_tensors": int(float8["layers"])}
           if float8 and float8.get("fsdp_float8_all_gather") else {}))
