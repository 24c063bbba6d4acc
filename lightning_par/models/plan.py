"""The parallel plan a model declares next to its architecture.

Model code holds no parallelism; instead each model returns a ``ParallelPlan`` saying *where*
techniques may be applied. Strategies read it:

- ``layers``: module paths that, applied one after another to the input, compute the model's
  output. Pipeline parallelism cuts this list into stages; each entry maps one tensor to one tensor.
- ``blocks``: the repeated blocks; the default FSDP/ZeRO-3 wrapping units and the units of
  activation checkpointing.
- ``tp_plan``: module path pattern (``*`` matches one path component) -> tensor-parallel style name
  (``colwise``, ``rowwise``, ``embedding``, ``sequence_parallel``, ``output``), read like a table.
- ``tp_divisible``: sizes that the tensor-parallel degree must divide (heads, hidden, vocabulary).

Paths are relative to the module that owns the plan; ``prefixed`` re-roots them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class ParallelPlan:
    layers: tuple[str, ...] = ()
    blocks: tuple[str, ...] = ()
    tp_plan: dict[str, str] = field(default_factory=dict)
    tp_divisible: dict[str, int] = field(default_factory=dict)

    def prefixed(self, prefix: str) -> "ParallelPlan":
        if not prefix:
            return self
        p = prefix.rstrip(".") + "."
        return replace(
            self,
            layers=tuple(p + x for x in self.layers),
            blocks=tuple(p + x for x in self.blocks),
            tp_plan={p + k: v for k, v in self.tp_plan.items()},
        )
