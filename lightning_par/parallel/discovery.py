"""What the strategies need to know about a model, derived from any ``nn.Module``.

``resolve_plan(module)`` is the one function that answers "where are this model's blocks, layers
and tensor-parallel styles?". Rules, in order (the first that gives blocks wins; the summary's
``units_rule`` says which):

1. ``declared``: the model's own ``parallel_plan()`` (``parallel/contract.py``).
2. ``hf_no_split_modules``: a Hugging Face ``PreTrainedModel`` anywhere inside the module (the module
   itself, or an attribute of a user's LightningModule): its ``_no_split_modules`` give the blocks,
   its tensor-parallel and pipeline plans the ``tp_plan`` and ``layers`` (``parallel/hf/plan.py``).
3. ``repeated_children``: the children of the model's largest ``ModuleList``/``Sequential`` whose
   children are all of one class (the transformer blocks of almost every model).
4. ``size``: modules of at least 1/8 of the model's parameters (the smallest such subtrees;
   FSDP1's size-based auto-wrap policy), so FSDP still overlaps communication.

A declared plan without blocks (say, only a ``tp_plan``) gets its blocks from rules 2-4. A declared
``tp_plan`` that splits a Hugging Face attention module's q/k/v by columns gets that module's head counts
divided by tp, as the derived plans do (``hf.plan.declared_head_division``).
Nothing here imports transformers: Hugging Face models are recognised by their attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import nn

from lightning_par.parallel.adapters.lora import lora_layers, with_lora_init
from lightning_par.parallel.contract import InitsWeights, ParallelPlan, declared_plan
from lightning_par.parallel.sharding.fsdp import resolve_units
from lightning_par.parallel.hf.experts import install as install_hf_experts
from lightning_par.parallel.hf.plan import (declared_head_division, find_hf_model, hf_enable_checkpointing, hf_init_fn,
                                            hf_parallel_plan, in_tagged_model)
from lightning_par.parallel.hf.stages import hf_stage_runner

RULES = ("declared", "hf_no_split_modules", "repeated_children", "size")
_CONTAINERS = (nn.ModuleList, nn.Sequential)


@dataclass(frozen=True)
class ResolvedPlan:
    plan: ParallelPlan
    units_rule: str  #: which rule chose ``plan.blocks`` (one of RULES)
    source: str  #: where layers/tp_plan came from: "declared", "huggingface:<path>" or "none"


def repeated_children(module: nn.Module) -> list[str]:
    """Paths of the children of the largest (by parameters) ModuleList/Sequential whose 2+ children
    all have one class; [] when there is none."""
    best: tuple[int, list[str]] = (0, [])
    for path, sub in module.named_modules():
        if not isinstance(sub, _CONTAINERS):
            continue
        children = list(sub.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        size = sum(p.numel() for p in sub.parameters())
        if size > best[0]:
            best = (size, [f"{path}.{name}" if path else name for name, _ in children])
    return best[1]


def size_based_blocks(module: nn.Module, fraction: int = 8) -> list[str]:
    """The smallest subtrees holding at least 1/``fraction`` of the parameters (never the root or a
    ModuleList/ModuleDict), in model order: FSDP's size rule with that minimum."""
    return resolve_units(module, max(1, sum(p.numel() for p in module.parameters()) // fraction))


def _hf_plan(module: nn.Module) -> tuple[ParallelPlan, str] | None:
    found = find_hf_model(module)
    if found is None:
        return None
    path, hf = found

    plan = hf_parallel_plan(hf)
    return (plan.prefixed(path), f"huggingface:{path or '.'}") if plan is not None else None


def _with_head_counts(module: nn.Module, plan: ParallelPlan) -> ParallelPlan:
    """A declared ``tp_plan`` splitting a Hugging Face attention module's projections by columns, with that
    module's head counts divided by tp and checked before launch as the derived plans do
    (``hf.plan.declared_head_division``), or refused in one line (``tp_refusal``) where they cannot be."""
    if not plan.tp_plan:
        return plan
    entries, divisible, refusal = declared_head_division(module, plan.tp_plan)
    if refusal:
        return replace(plan, tp_plan={}, tp_refusal=refusal)
    if not entries and not divisible:
        return plan
    return replace(plan, tp_plan={**plan.tp_plan, **entries}, tp_divisible={**plan.tp_divisible, **divisible})


def resolve_plan(module: nn.Module) -> ResolvedPlan:
    """The plan of ``module`` by the rules of the module docstring; for a module holding a Hugging Face
    model, with that model's pipeline stage runner and expert installer (``ParallelPlan.stage_runner``,
    ``install_experts``): the one place the generic techniques get Hugging Face code from."""
    resolved = _resolve(module)
    if find_hf_model(module) is None:
        return resolved
    plan = resolved.plan  # a model's own declared seams, if any, win
    return replace(resolved, plan=replace(plan, stage_runner=plan.stage_runner or hf_stage_runner,
                                          install_experts=plan.install_experts or install_hf_experts))


def _resolve(module: nn.Module) -> ResolvedPlan:
    plan = declared_plan(module)
    if plan is not None:
        plan = _with_head_counts(module, plan)
    if plan is not None and plan.blocks:
        return ResolvedPlan(plan, "declared", "declared")
    source = "declared" if plan is not None else "none"
    hf = _hf_plan(module)
    if hf is not None and plan is None:
        plan, source = hf
        if plan.blocks:
            return ResolvedPlan(plan, "hf_no_split_modules", source)
    plan = plan or ParallelPlan()
    blocks = repeated_children(module)
    if blocks:
        return ResolvedPlan(replace(plan, blocks=tuple(blocks)), "repeated_children", source)
    return ResolvedPlan(replace(plan, blocks=tuple(size_based_blocks(module))), "size", source)


def init_groups(module: nn.Module, blocks: tuple[str, ...] | list[str]) -> list[str]:
    """The groups in which a meta-device model is initialised: each block, then every other module
    owning parameters or buffers itself, in model order. Depends only on the model (never on the
    strategy), so the same seed gives the same weights under every strategy and world size."""
    blocks = list(blocks)
    inside = tuple(b + "." for b in blocks)
    groups = list(blocks)
    for path, sub in module.named_modules():
        if path in blocks or path.startswith(inside):
            continue
        if any(True for _ in sub.parameters(recurse=False)) or any(True for _ in sub.buffers(recurse=False)):
            groups.append(path)
    return groups


def init_fn_of(module: nn.Module) -> Callable[[nn.Module], None] | None:
    """How to initialise one submodule's own tensors: the model's ``init_weights`` (contract), a
    Hugging Face model's own init, or None (each submodule's ``reset_parameters()``); with LoRA adapters,
    that rule for the base and the adapters' own start (``adapters/lora.with_lora_init``)."""
    init = _model_init_fn(module)
    return with_lora_init(init) if lora_layers(module) else init


def _model_init_fn(module: nn.Module) -> Callable[[nn.Module], None] | None:
    if isinstance(module, InitsWeights):
        return module.init_weights
    found = find_hf_model(module)
    if found is None:
        return None
    hf_init = hf_init_fn(found[1])

    def init(sub: nn.Module) -> None:
        # the Hugging Face model's modules by its own rule; a layer the user's module holds beside it (a
        # classifier on a backbone) by its reset_parameters(), as a module without a Hugging Face model
        if in_tagged_model(sub):
            hf_init(sub)
        elif callable(reset := getattr(sub, "reset_parameters", None)):
            reset()

    return init


def checkpointing_fn_of(module: nn.Module) -> Callable[[nn.Module, str], bool] | None:
    """The model's own activation-checkpointing switch (Hugging Face's gradient checkpointing), as a
    function of the module to apply it to and the mode (``full`` / ``selective``) that returns whether it
    applied; None when there is none."""
    if find_hf_model(module) is None:
        return None

    def enable(target: nn.Module, mode: str) -> bool:
        found = find_hf_model(target)
        if found is None:  # e.g. a pipeline stage holding only some decoder layers
            return False
        return hf_enable_checkpointing(found[1], mode)

    return enable
