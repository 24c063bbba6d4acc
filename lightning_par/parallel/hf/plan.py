"""What a Hugging Face ``PreTrainedModel`` already declares, read as a ``ParallelPlan`` and helpers.

Duck-typed: nothing here imports ``transformers``; a model is recognised by its class hierarchy
(``is_hf_model``). Every path is relative to the Hugging Face model; prefix it with
``ParallelPlan.prefixed`` when the model sits inside another module. Read from the model:

- ``blocks``: the submodules whose class is in ``_no_split_modules`` (the decoder layers), outermost
  only: FSDP units and activation-checkpointing units.
- ``tp_plan``: the model's own tensor-parallel plan (``model._tp_plan``: the head's entries plus the
  config's ``base_model_tp_plan`` under ``base_model_prefix``), with Hugging Face's style names
  translated to ours (``HF_STYLES``: every style transformers 5.24's plans use, packed, expert and local
  ones included). A plan holding a style we do not know (one a later transformers adds) is dropped
  whole -- half a plan would compute wrong results -- so tensor parallelism then refuses the model as
  having no plan; rules naming modules this config does not build are skipped, as transformers does. A family declaring none gets the plan
  ``hf/tp_derive.py`` derives (GPT-2, OPT, BERT, RoBERTa, T5, BART, ViT), under the same verified-family gate.
- ``tp_divisible``: attention heads, key/value heads, MLP size and vocabulary from the config.
- ``layers``: the pipeline cut points from ``base_model_pp_plan`` (the base model's parts in forward
  order, a ``ModuleList`` expanded to its layers) followed by the head's ``_pp_plan``. They say where
  to cut, not how to run a part: decoder layers take the masks and rotary tables the model's forward
  builds, so each stage runs that forward itself (``hf/stages.py``). A model declaring no
  pipeline plan (GPT-2, OPT, Falcon, ...; the encoders BERT, RoBERTa) gets one derived from its
  forward (``hf/pp_derive.py``), with the layers a stage may start at (``hf_stage_starts``).

Tied parameters (GPT-2's and ``tie_word_embeddings``' input/output embedding): ``tied_parameters``
lists them and ``check_tied`` refuses the layouts that would silently untie them.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par.parallel.init.ties import retie, tied_parameters  # noqa: F401  (re-exported)
from lightning_par.parallel.contract import ParallelPlan
from lightning_par.parallel.hf.tp_derive import derived_tp_plan
from lightning_par.parallel.hf.tp_verified import tp_unverified_reason

log = logging.getLogger(__name__)

# Hugging Face tensor-parallel style -> ours (lightning_par.parallel.tensor.tp_styles.STYLES)
# (transformers' own list: ``transformers.integrations.tensor_parallel.ALL_PARALLEL_STYLES``; the
# styles it has that are missing here are refused by name, tests/test_hf_tp_registry.py walks them)
HF_STYLES = {
    "colwise": "colwise",  # q/k/v, gate/up: output features split
    "rowwise": "rowwise",  # o, down: input features split, outputs all-reduced
    "embedding_rowwise": "embedding",  # token table split by vocabulary rows
    "embedding_colwise": "embedding_colwise",  # token table split by hidden columns, output gathered
    "colwise_gather_output": "output",  # LM head: vocabulary split, logits gathered
    "colwise_rep": "colwise_gather",  # output features split, output gathered
    "rowwise_rep": "rowwise_split",  # replicated input split locally, outputs all-reduced
    "rowwise_split_input": "rowwise_split",
    "replicated_with_grad_allreduce": "replicate_local_heads",  # q/k norms on the local heads
    "sequence_parallel": "sequence_parallel",
    "replicate": "replicate",
    "packed_colwise": "packed_colwise",  # fused gate|up (experts' stacks, dim -2): each rank its slice of each part
    "packed_rowwise": "packed_rowwise",  # fused weights packed along the input dim (Llama-4's experts)
    "moe_tp_experts": "moe_experts",  # every expert split: local forward, the partial outputs summed
    "moe_identity_expert": "moe_identity",  # an identity expert inside such a module: input / tp
    "local_params": "local_params",  # a module using a split parameter itself (attention sinks)
    "all_reduce": "all_reduce",  # a module's partial output summed
    "mla_kv_a_proj": "mla_kv_a_proj",  # MLA's replicated kv_a projection: rotary part's gradient all-reduced
}
_PATH_TAG = "_lp_hf_path"  # survives copy.deepcopy: tells the init function where a module copy belongs


def is_hf_model(module: object) -> bool:
    """True for a ``transformers.PreTrainedModel`` (by class hierarchy, without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(module).__mro__)


def find_hf_model(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The outermost Hugging Face model inside ``module`` (itself included) and its path, or None."""
    for path, sub in module.named_modules():
        if is_hf_model(sub):
            return path, sub
    return None


# ---------------------------------------------------------------------------------------------
# The plan


def hf_blocks(model: nn.Module) -> tuple[str, ...]:
    """Paths of the outermost submodules whose class is in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: list[str] = []
    for path, sub in model.named_modules():
        if path and type(sub).__name__ in names and not any(path.startswith(f + ".") for f in found):
            found.append(path)
    return tuple(found)


def _full_tp_plan(model: nn.Module) -> dict[str, str]:
    plan = getattr(model, "_tp_plan", None)
    if plan:  # post_init has merged the head's and the prefixed base model's entries
        return dict(plan)
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    head = getattr(type(model), "_tp_plan", None) or {}
    return {**head, **{(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v for k, v in base.items()}}


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan in our style names; ``ValueError`` naming a style we lack. A
    family that declares none gets the plan ``hf.tp_derive`` derives for it (GPT-2, OPT, BERT, T5, ...), if any."""
    declared = _full_tp_plan(model)
    if not declared:
        return derived_tp_plan(model)[0]
    out = {}
    for pattern, style in declared.items():
        if not _names_something(model, pattern):
            continue  # a rule for modules this config does not build (dense layers of an all-MoE stack, a
            # LoRA-less q_proj): transformers skips it too (``verify_tp_plan`` only warns)
        if style not in HF_STYLES:
            raise ValueError(f"{type(model).__name__}'s tensor-parallel plan uses style {style!r} at {pattern!r}, "
                             f"which lightning_par does not implement (supported: {', '.join(HF_STYLES)})")
        ours = HF_STYLES[style]
        if ours == "mla_kv_a_proj":  # the rotary width the split needs, from the config as transformers reads it
            cfg = getattr(model, "config", None)
            cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
            rope = getattr(cfg, "qk_rope_head_dim", None)
            if not isinstance(rope, int):
                raise ValueError(f"{type(model).__name__}'s tensor-parallel plan uses style 'mla_kv_a_proj' at "
                                 f"{pattern!r}, but its config has no qk_rope_head_dim")
            ours = f"mla_kv_a_proj:{rope}"
        out[pattern] = ours
    return out


#: what an attention module sizes its views, splits or per-head tables by: head counts and the head widths the
#: derived plans divide (``hf.tp_derive``'s ``divide_attrs`` entries: GPT-2's ``split_size``, BERT's
#: ``all_head_size``, T5's ``inner_dim``); a colwise split of the module's projections leaves it 1/tp of each
HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads", "n_head",
              "n_kv_heads", "split_size", "all_head_size", "inner_dim")
_HEAD_SPLITS = ("colwise", "packed_colwise")  # column splits whose output is this rank's heads (not gathered)


def _head_attrs(module: nn.Module) -> list[str]:
    return [a for a in HEAD_ATTRS if type(getattr(module, a, None)) is int]


def declared_head_division(module: nn.Module, tp_plan: dict[str, str]) -> tuple[dict[str, str], dict[str, int], str]:
    """What a tensor-parallel plan the user declares (``parallel_plan().tp_plan``, paths in ``module``) needs
    beside itself where it splits a Hugging Face attention module's projections by columns: the module's
    head counts divided by tp, as the derived plans do (``divide_attrs`` entries: transformers' attention
    forwards view their projections as ``(B, T, self.num_heads, head_dim)``, StableLM's among them, which a
    rank holding some of the heads cannot), and those counts as sizes tp must divide (checked before launch).

    Returns (entries to add, sizes tp must divide, refusal). An attention module the plan names itself is left
    to the plan. The refusal (one line, '' if none): a part of such a module keeps a table per head for all
    of them (StableLM's ``qk_layernorm``: a LayerNorm per head, applied in order to the heads it is given),
    or a module above it holds a head count too (BLOOM's and MPT's ALiBi biases, built by the model for
    all heads; Falcon's only with ``alibi=True``: a config saying ``alibi=False`` is let through), which a
    rank holding some of the heads would apply to the wrong ones. Nothing for a plan over modules outside a
    Hugging Face model (a model of one's own sizes its views as it likes)."""
    from lightning_par.parallel.tensor.tensor_parallel import match_modules

    hf_roots = [path for path, sub in module.named_modules() if is_hf_model(sub)]
    if not hf_roots or not tp_plan:
        return {}, {}, ""

    def in_hf(path: str) -> bool:
        return any(not r or path == r or path.startswith(r + ".") for r in hf_roots)

    def named(path: str) -> bool:  # the plan names this module or one above it
        return any(_matches(p, ".".join(path.split(".")[:n])) for p in tp_plan
                   for n in range(1, len(path.split(".")) + 1))

    owners: dict[str, tuple[str, list[str]]] = {}  # attention path -> (its pattern, its column-split children)
    for pattern, style in tp_plan.items():
        if style.partition(":")[0] not in _HEAD_SPLITS:
            continue
        owner_pattern = pattern.rpartition(".")[0]
        for path in match_modules(module, pattern):
            owner = path.rpartition(".")[0]
            if owner and in_hf(owner) and owner != path:
                owners.setdefault(owner, (owner_pattern, []))[1].append(path.rpartition(".")[2])
    entries: dict[str, str] = {}
    divisible: dict[str, int] = {}
    by_pattern: dict[str, dict[str, tuple[str, ...]]] = {}
    seen: set[tuple[str, int]] = set()
    model = type(module.get_submodule(hf_roots[0]) if hf_roots[0] else module).__name__
    for owner, (owner_pattern, children) in owners.items():
        if any(_matches(p, owner) for p in tp_plan):
            continue  # the plan says what this module needs (a divide_attrs entry of its own, ...)
        attn = module.get_submodule(owner)
        attrs = tuple(_head_attrs(attn))
        if not attrs:
            continue  # views by -1 (Llama and most families): the local head count follows from the shapes
        for sub_path, sub in attn.named_modules():
            full = f"{owner}.{sub_path}"
            if sub_path and not named(full) and _head_attrs(sub) and any(True for _ in sub.parameters()):
                n = getattr(sub, _head_attrs(sub)[0])
                return {}, {}, (f"{model}: the declared tp_plan splits the heads of {owner} ({', '.join(children)} "
                                f"by columns), but {full} ({type(sub).__name__}) keeps a table per head for all {n} "
                                "heads, which a rank holding some of them would apply to the wrong heads; use tp=1 "
                                "(a data-parallel or sharded strategy)")
        root = min((r for r in hf_roots if not r or owner.startswith(r + ".")), key=len)  # the outermost
        cfg = getattr(module.get_submodule(root) if root else module, "config", None)
        parts = owner.split(".")
        for n in range(len(root.split(".")) if root else 0, len(parts)):  # the HF model down to the attention
            above = ".".join(parts[:n])
            holder = module.get_submodule(above) if above else module
            if _head_attrs(holder) and not any(_matches(p, above) for p in tp_plan) \
                    and getattr(cfg, "alibi", None) is not False:
                attr = _head_attrs(holder)[0]
                return {}, {}, (f"{model}: the declared tp_plan splits the heads of {owner} ({', '.join(children)} by "
                                f"columns), but {above or model} ({type(holder).__name__}) holds a head count "
                                f"({attr}={getattr(holder, attr)}) outside it, by which the model sizes tensors for "
                                "all heads (ALiBi biases) that a rank holding some of them would add to the wrong "
                                "heads; use tp=1 (a data-parallel or sharded strategy)")
        by_pattern.setdefault(owner_pattern, {})[owner] = attrs
        split = any(isinstance(p, DTensor) for c in children for p in attn.get_submodule(c).parameters())
        for attr in attrs if not split else ():  # split already: the counts are this rank's
            value = getattr(attn, attr)
            if (attr, value) not in seen:
                seen.add((attr, value))
                divisible[f"{owner}.{attr}"] = value
    for owner_pattern, found in by_pattern.items():
        if len(set(found.values())) == 1 and set(match_modules(module, owner_pattern)) == set(found):
            entries[owner_pattern] = "divide_attrs:" + ",".join(next(iter(found.values())))
        else:  # attention modules of several kinds under one pattern: each its own entry
            entries.update((owner, "divide_attrs:" + ",".join(attrs)) for owner, attrs in found.items())
    if entries:
        log.info("tensor parallel: the declared tp_plan splits the heads of %d Hugging Face attention module(s); their "
                 "head counts are divided by tp (%s)", len(owners), ", ".join(f"{k}: {v}" for k, v in entries.items()))
    return entries, divisible, ""


def _names_something(model: nn.Module, pattern: str) -> bool:
    """Whether ``pattern`` matches a module or a parameter of ``model``."""
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    return any(_matches(pattern, n) for n in names)


def hf_tp_divisible(model: nn.Module) -> dict[str, int]:
    """Sizes a tensor-parallel degree must divide, from the config (those it defines)."""
    if not _full_tp_plan(model):
        derived = derived_tp_plan(model)[1]
        if derived:
            return derived
    cfg = getattr(model, "config", None)
    keys = {"num_attention_heads": "attention heads", "num_key_value_heads": "key/value heads",
            "intermediate_size": "MLP size", "n_inner": "MLP size", "vocab_size": "vocab_size"}
    if "moe_tp_experts" in _full_tp_plan(model).values():  # every expert split too
        keys.update(moe_intermediate_size="expert MLP size", shared_expert_intermediate_size="shared expert MLP size")
    out: dict[str, int] = {}
    for key, label in keys.items():
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            out.setdefault(label, value)
    return out


def hf_derived_pp(model: nn.Module):  # noqa: ANN201 - hf_pp_derive.DerivedPP
    """The pipeline plan derived from ``model``'s forward (``hf.pp_derive``; for a model declaring none)."""
    from lightning_par.parallel.hf.pp_derive import derive_pp_plan

    return derive_pp_plan(model, hf_blocks(model), hf_experts(model)[0])


def hf_stage_starts(model: nn.Module) -> tuple[tuple[int, ...], str]:
    """Where a pipeline stage may start (indices into ``hf_layers``; () = at every layer) and, when the
    model has no pipeline plan at all, the one-line reason."""
    if getattr(getattr(model, "config", None), "base_model_pp_plan", None):
        return (), ""
    derived = hf_derived_pp(model)
    return derived.starts, derived.refusal


def hf_layers(model: nn.Module) -> tuple[str, ...]:
    """Pipeline cut points from ``base_model_pp_plan`` + the head's ``_pp_plan``, or derived from the
    model's forward when it declares none (``hf.pp_derive``); () when neither gives any."""
    cfg = getattr(model, "config", None)
    base = getattr(cfg, "base_model_pp_plan", None) or {}
    head = getattr(type(model), "_pp_plan", None) or {}
    if not base:
        return hf_derived_pp(model).layers
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(model, prefix) and getattr(model, prefix) is not model else ""
    layers: list[str] = []
    for name in [prefix + k for k in base] + list(head):
        try:
            sub = model.get_submodule(name)
        except AttributeError:  # a pipeline plan naming modules the model does not have: not usable
            log.warning("%s's pipeline plan names %r, which it lacks; no pipeline cut points", type(model).__name__, name)
            return ()
        if isinstance(sub, (nn.ModuleList, nn.Sequential)):
            layers.extend(f"{name}.{i}" for i in range(len(sub)))
        else:
            layers.append(name)
    return tuple(layers)


def hf_parallel_plan(model: nn.Module) -> ParallelPlan | None:
    """The ``ParallelPlan`` a Hugging Face model declares (paths relative to it); None for others."""
    if not is_hf_model(model):
        return None
    refusal = ""
    try:
        tp_plan = hf_tp_plan(model)
        refusal = tp_unverified_reason(model) if tp_plan else ""
    except ValueError as e:
        tp_plan, refusal = {}, str(e)
    if refusal:
        log.info("%s; tensor parallelism is unavailable for this model", refusal)
        tp_plan = {}
    experts, n_experts = hf_experts(model)
    starts, pp_refusal = hf_stage_starts(model)
    return ParallelPlan(layers=hf_layers(model), blocks=hf_blocks(model), tp_plan=tp_plan,
                        tp_divisible=hf_tp_divisible(model) if tp_plan else {}, tp_refusal=refusal,
                        experts=experts, n_experts=n_experts, stage_starts=starts, pp_refusal=pp_refusal)


def _matches(pattern: str, path: str) -> bool:
    """``*`` matches one path component (Hugging Face plans' convention)."""
    a, b = pattern.split("."), path.split(".")
    return len(a) == len(b) and all(x in ("*", y) for x, y in zip(a, b))


def _expert_patterns(model: nn.Module) -> list[str]:
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    return [k for k, v in plan.items() if v == "ep_dispatch_experts"]


def declares_experts(model: nn.Module) -> bool:
    """Whether the model's config declares routed-expert modules (``hf_experts``), from the config alone:
    the same on every rank, also one whose pipeline stage holds none of them."""
    return bool(_expert_patterns(model))


def hf_experts(model: nn.Module) -> tuple[tuple[str, ...], int]:
    """The routed-expert modules the config's ``base_model_ep_plan`` declares (style
    ``ep_dispatch_experts``: stacked weights whose dim 0 is the expert, called with
    ``(hidden_states, top_k_index, top_k_weights)``) and their expert count; ((), 0) without any."""
    patterns = _expert_patterns(model)
    if not patterns:
        return (), 0
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(model, prefix) and getattr(model, prefix) is not model else ""
    paths = tuple(path for path, _ in model.named_modules()
                  if any(_matches(prefix + pat, path) for pat in patterns))
    counts = {p.shape[0] for path in paths for p in model.get_submodule(path).parameters(recurse=False)}
    if len(counts) != 1:  # no stacked weights, or stacks of different lengths: not the declared layout
        return (), 0
    return paths, counts.pop()


# ---------------------------------------------------------------------------------------------
# Tied parameters




def declared_ties(model: nn.Module) -> list[tuple[str, str]]:
    """Pairs ``(source, target)`` the model says must share a parameter (``all_tied_weights_keys``),
    whether or not they currently do (a model materialised with ``to_empty`` has lost its ties)."""
    found = find_hf_model(model)
    if found is None:
        return []
    path, hf = found
    keys = getattr(hf, "all_tied_weights_keys", None) or {}
    p = f"{path}." if path else ""
    return [(p + src, p + dst) for dst, src in keys.items()]




def check_tied(model: nn.Module, *, tp: int = 1, pp: int = 1, layers: tuple[str, ...] | None = None) -> None:
    """Raise a one-line ``ValueError`` if a layout would silently untie ``model``'s tied parameters.

    A pipeline puts the embedding on the first stage and the head on the last; each keeps a copy,
    kept equal as Megatron-LM's embedding group does (``pipeline/stage_ties.py``) -- possible when every use
    of the shared weight lies inside a pipeline layer (``layers``, paths in ``model``; default: the
    model's own pipeline plan). Tensor parallelism keeps the tie when both uses split the weight
    alike (vocabulary rows; ``tensor_parallel._retie_split`` re-ties or refuses in one line).
    Data-parallel strategies keep ties (FSDP2 shards a shared parameter once, in one unit).
    """
    pairs = tied_parameters(model) or declared_ties(model)
    if not pairs or pp <= 1:
        return
    from lightning_par.parallel.pipeline.stage_ties import layer_of

    found = find_hf_model(model)
    if layers is None:  # the Hugging Face model's own pipeline plan, under its path in ``model``
        prefix = f"{found[0]}." if found and found[0] else ""
        layers = tuple(prefix + x for x in hf_layers(found[1])) if found else ()
    if not layers:  # no pipeline plan at all: the pipeline's own check refuses the model, saying so
        return
    outside = [name for pair in pairs for name in pair if layer_of(name, layers) is None]
    if not outside:
        return
    # advice that can be followed: tie_word_embeddings unties only the output head from the input table
    head = getattr(found[1], "get_output_embeddings", lambda: None)() if found else None
    where = [f"{found[0]}.{n}".strip(".") + "." for n, m in found[1].named_modules() if m is head] if found else []
    head_only = bool(where) and all(a.startswith(where[0]) or b.startswith(where[0]) for a, b in pairs)
    flag = getattr(getattr(found[1], "config", None), "tie_word_embeddings", None) if found else None
    fix = ("build the model with tie_word_embeddings=false or use pp=1" if head_only and flag
           else "no option of the model unties them (e.g. T5's shared encoder/decoder table): use pp=1 (a "
                "data-parallel, sharded or tensor-parallel strategy)")
    raise ValueError(f"{type(model).__name__} ties {pairs[0][0]} and {pairs[0][1]}, but {outside[0]} lies outside "
                     f"every pipeline layer, so no stage of a pipeline (pp={pp}) would own it -- {fix}")


def verify_ties(model: nn.Module) -> None:
    """Raise a one-line ``ValueError`` if a tie the model declares is no longer one shared parameter
    (call after setup: ``to_empty`` and per-module parameter replacement untie silently)."""
    for src, dst in declared_ties(model):
        try:
            a, b = model.get_parameter(src), model.get_parameter(dst)
        except AttributeError:
            continue  # one side lives on another pipeline rank (refused by check_tied) or was cut away
        if a is not b:
            raise ValueError(f"{type(model).__name__}: {dst} is declared tied to {src} but is a separate parameter "
                             "after setup; re-tie after materialising (hf_plan.retie)")


# ---------------------------------------------------------------------------------------------
# Initialisation


def in_tagged_model(module: nn.Module) -> bool:
    """Whether ``module`` (or a copy of it) belongs to a model ``tag_paths`` tagged."""
    return getattr(module, _PATH_TAG, None) is not None


def tag_paths(model: nn.Module) -> None:
    """Record every submodule's path on it (copies made later with ``copy.deepcopy`` keep it)."""
    for path, sub in model.named_modules():
        setattr(sub, _PATH_TAG, path)


@contextlib.contextmanager
def _frozen(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Mark tensors as initialised for Hugging Face's guarded ``transformers.initialization`` functions."""
    marked = [t for t in tensors if not getattr(t, "_is_hf_initialized", False)]
    for t in marked:
        t._is_hf_initialized = True
    try:
        yield
    finally:
        for t in marked:
            del t._is_hf_initialized


def hf_init_fn(model: nn.Module) -> Callable[[nn.Module], None]:
    """A function initialising exactly the parameters and buffers a submodule of ``model`` owns, with the
    values' distribution ``from_config`` gives them.

    Hugging Face initialises bottom-up (children, then parents) with the model's ``_init_weights``,
    and a parent's rule may overwrite a child's parameter (GPT-2 rescales ``c_proj`` in its attention
    and MLP). So for a module the function runs ``_init_weights`` on the module, then on each of its
    ancestors (nearest first), with every tensor the module does not own marked as initialised (the
    guard Hugging Face's own init functions honour): the result does not depend on the order in which
    submodules are visited. The values follow the same laws as ``from_config`` (not the same draws:
    ``from_config`` also spends random numbers in torch's own constructors). A tied target (``lm_head.weight``) still sharing its source's tensor is left to the source,
    as Hugging Face does; an untied copy of it (a module copied on its own) is initialised. Rotary
    ``inv_freq`` buffers (non-persistent, garbage after ``to_empty``) are recomputed by the same rule.

    ``module`` may be a submodule of ``model`` or a ``copy.deepcopy`` of one made after this call
    (the path is recorded on every submodule); ``model`` itself may live on the meta device.
    """
    tag_paths(model)
    found = find_hf_model(model)
    if found is None:
        raise ValueError(f"hf_init_fn: {type(model).__name__} contains no Hugging Face model")
    ties = {dst: src for src, dst in declared_ties(model)}

    def is_tied_target(path: str, name: str, t: torch.Tensor) -> bool:
        src = ties.get(f"{path}.{name}" if path else name)
        if src is None:
            return False
        try:
            return model.get_parameter(src) is t  # still tied: its source sets it
        except AttributeError:  # the source lives on another pipeline stage: this copy is set here
            return False

    def init(module: nn.Module) -> None:
        path = getattr(module, _PATH_TAG, None)
        if path is None:
            raise ValueError(f"init_weights: this {type(module).__name__} is not a submodule of the model the "
                             "init function was made for (call hf_init_fn(model) before copying modules)")
        owned = [t for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
                 if t is not None and not is_tied_target(path, name, t)]
        if not owned:
            return
        owned_ids = {id(t) for t in owned}
        parts = path.split(".") if path else []
        chain = [".".join(parts[:i]) for i in range(len(parts), -1, -1)]  # the module, then its ancestors
        for anc_path in chain:
            anc = module if anc_path == path else model.get_submodule(anc_path)
            hf_owner = _nearest_hf(model, anc_path)
            with _swapped(model, path, module), torch.no_grad():
                others = [t for t in [*anc.parameters(), *anc.buffers()] if id(t) not in owned_ids]
                with _frozen(others):
                    hf_owner._init_weights(anc)

    return init


def _nearest_hf(model: nn.Module, path: str) -> nn.Module:
    parts = path.split(".") if path else []
    for i in range(len(parts), -1, -1):
        sub = model.get_submodule(".".join(parts[:i]))
        if is_hf_model(sub):
            return sub
    raise ValueError(f"no Hugging Face model above {path!r}")


@contextlib.contextmanager
def _swapped(model: nn.Module, path: str, module: nn.Module) -> Iterator[None]:
    """Temporarily put ``module`` (a copy) at ``path`` of ``model`` so ancestors' rules reach it."""
    if not path or model.get_submodule(path) is module:
        yield
        return
    owner_path, _, leaf = path.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    original = owner._modules[leaf]
    owner._modules[leaf] = module
    try:
        yield
    finally:
        owner._modules[leaf] = original


def hf_init_all(model: nn.Module, init: Callable[[nn.Module], None] | None = None) -> None:
    """Initialise every submodule of ``model`` bottom-up (Hugging Face's order) and restore its ties."""
    init = init or hf_init_fn(model)
    for sub in reversed(list(model.modules())):
        init(sub)
    retie(model, declared_ties(model))


# ---------------------------------------------------------------------------------------------
# Activation checkpointing


def hf_enable_checkpointing(model: nn.Module, mode: str | int = "full") -> bool:
    """Switch on the Hugging Face model's own activation checkpointing (non-reentrant) for every Hugging
    Face model inside ``model``, ``full`` or ``selective`` (``parallel/memory/checkpointing.py``'s policy,
    handed to torch's checkpoint through transformers), or for k every k-th decoder layer by its index in the
    whole model (the others switched off again); False when there is none or it does not support it."""
    found = find_hf_model(model)
    if found is None or not getattr(found[1], "supports_gradient_checkpointing", False):
        return False
    hf = found[1]
    kwargs: dict = {"use_reentrant": False}
    if mode == "selective":
        from lightning_par.parallel.memory.checkpointing import selective_context

        kwargs["context_fn"] = selective_context
    if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.x name
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if isinstance(mode, int):  # the layers' own switch, by the index in their path (a pipeline stage keeps full paths)
        for path, layer in hf.named_modules():
            index = re.search(r"(?:^|\.)(\d+)$", path)
            if index and getattr(layer, "gradient_checkpointing", False) and int(index.group(1)) % mode:
                layer.gradient_checkpointing = False
    return True
