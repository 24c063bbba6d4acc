"""``pipeline``: pipeline parallelism -- the model's declared layers cut into stages, one per rank
(or ``virtual_stages`` per rank), micro-batches flowing through a schedule.

Each rank holds only its stages' parameters, gradients and optimizer state. A batch is split into
``n_microbatches`` micro-batches; the schedule decides the order of their forwards (F) and
backwards (B) on every stage:

- ``gpipe``: all forwards, then all backwards; activations of all m micro-batches are alive at once.
- ``1f1b``: after p warm-up forwards, one forward then one backward; at most p micro-batches'
  activations alive on the first stage. Same bubble as GPipe, ``(p-1)/(m+p-1)`` of the step.
- ``interleaved_1f1b``: v stages per rank (loop placement): bubble ``(p-1)/(v*m+p-1)``.
- ``zb`` / ``zbv``: zero-bubble schedules (backward split into input-grad I and weight-grad W).
- ``n_microbatches=1``: naive vertical model parallelism, one stage busy at a time, bubble (p-1)/p.

Everything about running inside Lightning (the schedule inside ``training_step``, gradients handed
to ``backward``, per-stage optimizers, global-norm clipping, sharded checkpoints) is shared with the
other model-parallel strategies in ``composite.py``; this class is its pipeline-only preset. All
ranks of a pipeline read the same batch (the data-parallel size is world / pp, 1 by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_par.strategies.composite import MeshParallelStrategy


class PipelineStrategy(MeshParallelStrategy):
    """Pipeline parallelism over ``pp`` ranks (default: all of them).

    Args:
        schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zb`` or ``zbv``.
        n_microbatches: micro-batches per batch; None: one per pipeline rank. 1f1b-type schedules
            need at least pp; the per-pipeline batch must be a multiple of it.
        virtual_stages: stages per rank; None: 2 for interleaved_1f1b / zb / zbv, else 1.
        balance: ``params`` (equal parameter counts) or ``time`` (equal measured forward + backward
            time of the layers, measured on rank 0) -- used when ``split_points`` is None.
        split_points: explicit cut: the first layer of every stage after the first (a path from the
            model's ``parallel_plan().layers`` such as ``net.blocks.2``, or its index).
        pp: pipeline ranks; None: the world size. Fewer: data parallel (gradient averaging) over
            world / pp pipelines.
        activation_checkpointing: true or "full" recomputes each block in backward, "selective" keeps matmuls,
            k (an int) recomputes every k-th block.
    """

    strategy_name = "lp_pipeline"

    def __init__(self, schedule: str = "1f1b", n_microbatches: int | None = None, virtual_stages: int | None = None,
                 balance: str = "params", split_points: Sequence[int | str] | None = None, pp: int | None = None,
                 activation_checkpointing: bool | str = False, **kwargs: Any) -> None:
        super().__init__(pp=pp, tp=1, data_parallel="replicate", schedule=schedule, n_microbatches=n_microbatches,
                         virtual_stages=virtual_stages, balance=balance, split_points=split_points,
                         activation_checkpointing=activation_checkpointing, pipelined=True, **kwargs)
