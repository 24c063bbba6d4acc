"""The typed contract between a model and the strategies: what a model *may* declare.

Nothing here is required. A plain ``nn.Module`` / ``LightningModule`` trains under every
data-parallel strategy; the strategies derive what they need from the module itself
(``parallel/discovery.py``: its repeated blocks, a Hugging Face model's ``_no_split_modules``,
``base_model_tp_plan``, ``base_model_pp_plan``). A model declares more only where a technique needs
knowledge that cannot be read off the module:

- ``parallel_plan()`` -> ``ParallelPlan``: where a pipeline may cut it (``layers``), its blocks
  (FSDP units, activation-checkpointing units), its tensor-parallel styles (``tp_plan``) and the
  sizes the tp degree must divide (``tp_divisible``).
- ``loss_fn(output, target)``: the loss as a function of the model's output, which a pipeline's
  last stage and loss-parallel computation call on their own.
- ``example_input(batch_size, device)``: an input batch of the right shape (time-balanced
  pipeline cuts, FLOP counting).
- ``init_weights(module)``: initialise the parameters and buffers that ``module`` itself owns
  (not its children's). Used to materialise a model built on the meta device: the strategies
  build each init group of the full model on the host, call this on every submodule of it, and
  keep only the local shard. Without it, each submodule's ``reset_parameters()`` is used.

Strategies query a model only through the accessor functions below (no ``getattr`` probing
elsewhere), so what a model may declare is written down once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@dataclass(frozen=True)
class ParallelPlan:
    """Where techniques may be applied to a model; paths are relative to the module owning the plan.

    - ``layers``: module paths that, applied one after another to the input, compute the model's
      output; each maps one tensor to one tensor. Pipeline parallelism cuts this list into stages.
    - ``blocks``: the repeated blocks: FSDP/ZeRO-3 units and activation-checkpointing units.
    - ``tp_plan``: module path pattern (``*`` matches one path component) -> tensor-parallel style
      (``colwise``, ``rowwise``, ``embedding``, ``output``, ``sequence_parallel``, ``position``,
      ``replicate``).
    - ``tp_divisible``: sizes the tensor-parallel degree must divide (heads, hidden, vocabulary).
    """

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


@runtime_checkable
class DeclaresPlan(Protocol):
    def parallel_plan(self) -> ParallelPlan: ...


@runtime_checkable
class HasLossFn(Protocol):
    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class HasExampleInput(Protocol):
    def example_input(self, batch_size: int, device: torch.device | str = "meta") -> torch.Tensor: ...


@runtime_checkable
class InitsWeights(Protocol):
    def init_weights(self, module: nn.Module) -> None: ...


def declared_plan(module: nn.Module) -> ParallelPlan | None:
    """The plan ``module`` declares itself, or None."""
    return module.parallel_plan() if isinstance(module, DeclaresPlan) else None


def loss_fn_of(module: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    return module.loss_fn if isinstance(module, HasLossFn) else None


def example_input_of(module: nn.Module) -> Callable[..., torch.Tensor] | None:
    return module.example_input if isinstance(module, HasExampleInput) else None


def input_kind_of(module: object) -> str | None:
    """What a model consumes (``tokens``, ``vectors``, ``images``) or a datamodule gives, if declared."""
    kind = getattr(module, "input_kind", None) or getattr(module, "kind", None)
    return kind if isinstance(kind, str) else None
