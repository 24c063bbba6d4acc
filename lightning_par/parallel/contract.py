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
- ``_lp_pretrained = Pretrained(directory)`` on any submodule (set by ``lightning_par.from_pretrained``
  and ``HFCausalLM(pretrained=...)``): that submodule's weights come from a ``save_pretrained``
  directory, each rank reading only its shards (``parallel/init/weights.py``), not from its init.

Strategies query a model only through the accessor functions below (no ``getattr`` probing
elsewhere), so what a model may declare is written down once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


#: ``(model, layers, start, end)`` -> a callable ``(x, get_submodule, **batch_fields) -> output`` running
#: ``layers[start:end]`` through the model's own forward, or None (see ``ParallelPlan.stage_runner``)
StageRunnerFactory = Callable[[nn.Module, Sequence[str], int, int], Callable[..., torch.Tensor] | None]


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
    - ``tp_refusal``: why a plan the model declares cannot be used (one line naming the style and
      the model), given instead of ``tp_plan``; tensor parallelism refuses with it.
    - ``experts``: the routed-expert modules expert parallelism shards over ``ep`` (stacked weights
      whose dim 0 is the expert: our ``Experts``, or a Hugging Face experts module taking
      ``(hidden_states, top_k_index, top_k_weights)``); ``n_experts``: experts in each (what ep divides).
    - ``stage_starts``: the indices of ``layers`` at which a pipeline stage may start (0 among them);
      () means at every layer. A model whose forward passes something other than the previous
      layer's output into a layer (GPT-2's ``wpe`` takes position ids) must not be cut before it:
      balanced cuts keep to these, explicit ``split_points`` elsewhere are refused.
    - ``pp_refusal``: why no pipeline plan could be found for the model (one line); a pipeline
      refuses with it.
    - ``stage_runner``: ``(model, layers, start, end) -> runner or None``: how a pipeline stage of
      ``layers[start:end]`` runs the model's own forward (``runner(x, get_submodule, **batch_fields)``);
      None, or a None runner: the stage calls its layers one after another. Set by the plan's discovery
      for a Hugging Face model (``parallel/hf/stages.py``), so the generic pipeline code never imports it.
    - ``install_experts``: ``(module, dispatch, n_experts)``: puts expert parallelism's dispatcher into an
      experts module that does not call one itself (a Hugging Face experts module); None: the module has a
      ``dispatch`` attribute (our ``Experts``), or expert parallelism refuses it.
    """

    layers: tuple[str, ...] = ()
    blocks: tuple[str, ...] = ()
    tp_plan: dict[str, str] = field(default_factory=dict)
    tp_divisible: dict[str, int] = field(default_factory=dict)
    tp_refusal: str = ""
    experts: tuple[str, ...] = ()
    n_experts: int = 0
    stage_starts: tuple[int, ...] = ()
    pp_refusal: str = ""
    stage_runner: StageRunnerFactory | None = field(default=None, compare=False, repr=False)
    install_experts: Callable[[nn.Module, Any, int], None] | None = field(default=None, compare=False, repr=False)

    def prefixed(self, prefix: str) -> "ParallelPlan":
        if not prefix:
            return self
        p = prefix.rstrip(".") + "."
        return replace(
            self,
            layers=tuple(p + x for x in self.layers),
            blocks=tuple(p + x for x in self.blocks),
            tp_plan={p + k: v for k, v in self.tp_plan.items()},
            experts=tuple(p + x for x in self.experts),
        )


@dataclass(frozen=True)
class Pretrained:
    """A submodule's state-dict keys (relative to it) are read from ``directory`` (``config.json`` +
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``, as ``save_pretrained`` writes)."""

    directory: str


PRETRAINED_ATTR = "_lp_pretrained"


def mark_pretrained(module: nn.Module, directory: str) -> nn.Module:
    setattr(module, PRETRAINED_ATTR, Pretrained(str(directory)))
    return module


def pretrained_of(module: nn.Module) -> dict[str, Pretrained]:
    """Module path (``""``: the root) -> the pretrained directory its weights come from."""
    return {path: getattr(sub, PRETRAINED_ATTR) for path, sub in module.named_modules()
            if isinstance(getattr(sub, PRETRAINED_ATTR, None), Pretrained)}


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


@runtime_checkable
class ForwardStatsSource(Protocol):
    """A layer that keeps figures of its training forwards until they are read: an MoE layer's routed
    tokens per expert, all-to-all bytes (``last_stats``, summed over the forwards since
    ``clear_stats``; ``callbacks/moe.py`` reads and clears them after every batch). A pipeline
    clears them before each step and afterwards keeps only its micro-batches' (``keep_last_forwards(n)``:
    a stage's first step runs one more forward, to infer shapes). A module that is none itself may
    carry one as its ``STATS_ATTR`` attribute (a Hugging Face experts module: ``callbacks/moe.py``)."""

    @property
    def last_stats(self) -> dict[str, Any]: ...

    def clear_stats(self) -> None: ...

    def keep_last_forwards(self, n: int) -> None: ...


STATS_ATTR = "lp_forward_stats"


def forward_stats_sources(modules: Iterable[nn.Module]) -> list[ForwardStatsSource]:
    """Every ``ForwardStatsSource`` inside ``modules``: the modules that are one, and those attached."""
    found = []
    for mod in modules:
        for m in mod.modules():
            found += [s for s in (m, getattr(m, STATS_ATTR, None)) if isinstance(s, ForwardStatsSource)]
    return found


@runtime_checkable
class AuxLossSource(ForwardStatsSource, Protocol):
    """A layer that computes an auxiliary training loss inside its forward (an MoE router's balance
    and z-losses). Normally the LightningModule adds it to the loss it returns. A pipeline stage
    returns only its activations, so ``parallel/pipeline/schedule.py`` sets ``aux_grad_scale`` (the scale of
    each micro-batch's loss) and the layer feeds the gradient of ``aux_grad_scale x aux`` into
    backward itself; ``aux_sum`` (detached, summed over its forwards as kept by ``ForwardStatsSource``)
    is what it added."""

    aux_grad_scale: float | None

    @property
    def aux_sum(self) -> torch.Tensor | None: ...


def aux_loss_sources(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Every ``AuxLossSource`` inside ``modules``."""
    return [m for mod in modules for m in mod.modules() if isinstance(m, AuxLossSource)]


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
