"""``tensor_parallel``: Megatron-style tensor parallelism on DTensor, from the model's declared plan.

Every weight matrix named in ``parallel_plan().tp_plan`` is split over the ``tp`` ranks (column
splits for q/k/v and the MLP's first linear, row splits for the projections after them, the
vocabulary split for the embedding and the LM head): each rank holds 1/tp of those parameters,
gradients and optimizer state, and one all-reduce per attention and per MLP joins the partial
results (see ``parallel/tensor/tensor_parallel.py`` for the math). Options:

- ``sequence_parallel``: LayerNorms and the activations between blocks are sharded along the
  sequence too (the all-reduces become reduce-scatter + all-gather pairs; less activation memory).
- ``loss_parallel``: the LM head's logits stay sharded over the vocabulary and the cross-entropy
  is computed on the shards (no gather of the ``(B, T, vocab)`` logits). The strategy then runs
  the forward and the model's ``loss_fn`` itself inside ``loss_parallel()``, and backward inside
  it too, and logs ``train/loss`` / ``val/loss``.

All ranks of a tensor-parallel group read the same batch (dp = world / tp, 1 by default). A model
without a plan, or a tp that does not divide its heads / hidden / vocabulary, stops with a one-line
error before processes start. The Lightning plumbing is shared with the other model-parallel
strategies in ``composite.py``; this class is its TP-only preset.
"""

from __future__ import annotations

from typing import Any

from lightning_par.strategies.composite import MeshParallelStrategy


class TensorParallelStrategy(MeshParallelStrategy):
    """Tensor parallelism over ``tp`` ranks (default: all of them).

    Args:
        tp: tensor-parallel ranks; None: the world size. Fewer: data parallel (gradient
            averaging) over world / tp groups.
        sequence_parallel: shard LayerNorms and the activations between blocks on the sequence dim.
        loss_parallel: cross-entropy on vocabulary-sharded logits (needs the model's ``loss_fn``).
        activation_checkpointing: true or "full" recomputes each block in backward, "selective" keeps matmuls,
            k (an int) recomputes every k-th block.
    """

    strategy_name = "lp_tensor_parallel"

    def __init__(self, tp: int | None = None, sequence_parallel: bool = False, loss_parallel: bool = False,
                 activation_checkpointing: bool | str = False, **kwargs: Any) -> None:
        super().__init__(pp=1, tp=tp, data_parallel="replicate", sequence_parallel=sequence_parallel,
                         loss_parallel=loss_parallel, activation_checkpointing=activation_checkpointing, **kwargs)
