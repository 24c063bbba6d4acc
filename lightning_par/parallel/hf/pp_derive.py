"""A pipeline plan for a Hugging Face model that declares none (GPT-2, OPT, Falcon, Bloom, ...; the
encoders BERT and RoBERTa), read off the model itself: no per-family table.

``derive_pp_plan`` traces one forward of a meta-device copy of the model and takes, in call order,
the modules holding parameters at the level of the blocks (the ``_no_split_modules`` blocks, all in
one ``ModuleList``): the children of the blocks' ancestors that are not ancestors of the blocks
themselves -- the modules before the blocks (GPT-2: ``wte``, ``wpe``; OPT: ``embed_tokens``,
``embed_positions``, ``project_in``; BERT: ``embeddings``), the blocks, the modules after them
(``ln_f``, ``final_layer_norm``, ``project_out``; BERT's pooler) and the head. Every parameter must
lie in one of them and each must be called exactly once; otherwise the model gets no plan and a
one-line reason. Decoder-only language models (``GenerationMixin`` in the class hierarchy) get one,
and so do encoder-only models whose forward takes ``input_ids`` and ``inputs_embeds`` (BERT's and
RoBERTa's heads): an encoder's ``_no_split_modules`` name its embeddings module too, so its blocks
are those lying in the one list of layers (``encoder_stack``); the forward builds the (bidirectional)
attention mask from ``inputs_embeds`` on every stage. A pipeline's last stage hands the head's output
to the module's ``loss_fn(output, target)`` (a masked LM: logits over the sequence, targets -100
where not masked). Encoder-decoder models (T5, BART) are refused in one line: every decoder layer's
cross-attention reads the encoder's output, and only one activation crosses a cut. Vision encoders
(ViT: ``pixel_values``, no ``inputs_embeds``) are refused in one line too. The layers returning a
tuple are recorded (``tuple_out``: Falcon's, Bloom's blocks), so a stage's stand-in for one returns a
tuple too.

Where a stage may start (``starts``). A stage boundary before layer ``i`` is correct only if the
forward hands the rest of the model everything the earlier layers computed through the tensor
layer ``i`` is called with (``hf.stages``: that tensor is what crosses the cut; the later stage
recomputes masks, positions and rotary tables from ``inputs_embeds`` and skips the earlier layers).
GPT-2 adds ``wte(input_ids) + wpe(position_ids)``: ``wpe`` is called with the position ids, so a
cut before it would send the positions as the activation and train a wrong model without any
error. The trace decides this from the autograd graph of the meta forward: a cut before layer
``i`` is allowed when no parameter of an earlier layer reaches the output except through the
tensor layer ``i`` is called with (a parameter shared with a later layer, a tied embedding, is
the pipeline's tie group's business: ``pipeline/stage_ties.py``). What the graph cannot see -- a later
layer reading an earlier one's values without gradient -- is not checked; decoders do not.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class DerivedPP:
    """A derived pipeline plan: ``layers`` in call order, the indices a stage may start at
    (``starts``, always holding 0), or ``refusal`` (one line) and no layers."""

    layers: tuple[str, ...] = ()
    starts: tuple[int, ...] = ()
    refusal: str = ""
    tuple_out: tuple[tuple[str, int], ...] = ()  # (layer, length) of the layers returning a tuple




_CACHE: "weakref.WeakKeyDictionary[nn.Module, DerivedPP]" = weakref.WeakKeyDictionary()


def meta_copy(hf: nn.Module) -> nn.Module:
    """``hf`` itself when it is all on the meta device, else a fresh meta-device model of its class
    and config (the real one may be large, already cut, or wrapped)."""
    if all(t.is_meta for t in [*hf.parameters(), *hf.buffers()]):
        return hf
    with torch.device("meta"):
        return type(hf)._from_config(copy.deepcopy(hf.config))


@contextlib.contextmanager
def shape_only(model: nn.Module, paths: Sequence[str]) -> Iterator[None]:
    """Within the block, the modules at ``paths`` (routed experts) return zeros shaped like their
    input: routing reads values (which experts got tokens) that meta tensors lack."""
    mods = [model.get_submodule(p) for p in paths]
    saved = [m.__dict__.get("forward") for m in mods]
    for m in mods:
        m.forward = lambda hidden_states, *args, **kwargs: torch.zeros_like(hidden_states)
    try:
        yield
    finally:
        for m, f in zip(mods, saved):
            if f is None:
                del m.forward
            else:
                m.forward = f


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    if args:
        return args[0] if isinstance(args[0], torch.Tensor) else None
    for key in ("hidden_states", "input", "x"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    return None


def meta_mask_options(seq_len: int) -> list[dict[str, torch.Tensor]]:
    """The ``attention_mask`` arguments a meta-device forward is tried with, in order: meta tensors have
    no values, and building a mask reads some (transformers looks for packed sequences), so an explicit
    4-d causal mask first; then none (OPT builds its positions from the mask's values) and a 2-d one
    (Bloom's ALiBi)."""
    return [{"attention_mask": torch.ones(seq_len, seq_len, dtype=torch.bool, device="meta").tril()[None, None]},
            {}, {"attention_mask": torch.ones(1, seq_len, dtype=torch.long, device="meta")}]


def meta_forward(model: nn.Module, ids: torch.Tensor, before: Callable[[], None] = lambda: None,
                 **kwargs: object) -> tuple[Any, dict[str, torch.Tensor]]:
    """``model(input_ids=ids)`` on the meta device under the first of ``meta_mask_options`` that runs
    (``before`` is called before each attempt); its output and that option. Raises the first option's
    error when none runs."""
    first: Exception | None = None
    for option in meta_mask_options(ids.shape[1]):
        before()
        try:
            return model(input_ids=ids, use_cache=False, **option, **kwargs), option
        except Exception as e:  # noqa: BLE001 - whatever the model's own forward raises on meta tensors
            first = first or e
    assert first is not None
    raise first


def derive_pp_plan(model: nn.Module, blocks: Sequence[str], experts: Sequence[str] = (),
                   seq_len: int = 8) -> DerivedPP:
    """The pipeline plan of ``model`` (a Hugging Face model declaring none) read off its forward; see the
    module docstring. ``blocks``: its decoder blocks (``hf.plan.hf_blocks``); ``experts``: routed-expert
    modules (run shape-only). Cached per model."""
    cached = _CACHE.get(model)
    if cached is None:
        try:
            cached = _derive(model, tuple(blocks), tuple(experts), seq_len)
        except Exception as e:  # noqa: BLE001 - deriving must never break a strategy that needs no pipeline
            cached = DerivedPP(refusal=f"{type(model).__name__} declares no pipeline plan and deriving one failed "
                                       f"({type(e).__name__})")
        _CACHE[model] = cached
    return cached


def _derive(model: nn.Module, blocks: tuple[str, ...], experts: tuple[str, ...], seq_len: int) -> DerivedPP:
    name = type(model).__name__
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return DerivedPP(refusal=f"{name} is an encoder-decoder model: every decoder layer's cross-attention reads "
                                 "the encoder's output, which a pipeline stage does not receive (only one "
                                 "activation crosses a cut); pipeline parallelism does not support it")
    generative = any(c.__name__ == "GenerationMixin" for c in type(model).__mro__)
    takes = [k for k in inspect.signature(type(model).forward).parameters if k != "self"]
    if not generative and ("input_ids" not in takes or "inputs_embeds" not in takes):  # a vision encoder (ViT)
        return DerivedPP(refusal=f"{name} declares no pipeline plan, and one is derived only for a model whose forward "
                                 "takes input_ids (the first stage) and inputs_embeds (every later one); its forward "
                                 f"takes {', '.join(takes[:2])}, ...")
    if not blocks:
        return DerivedPP(refusal=f"{name} declares no pipeline plan and no decoder blocks (_no_split_modules) "
                                 "to derive one from")
    if not generative:  # an encoder (BERT): its embeddings are a block too, beside the one list of layers
        blocks = encoder_stack(model, blocks)
    parents = {b.rpartition(".")[0] for b in blocks}
    if len(parents) != 1 or not isinstance(model.get_submodule(next(iter(parents))), (nn.ModuleList, nn.Sequential)):
        return DerivedPP(refusal=f"{name} declares no pipeline plan and its decoder blocks are not one list "
                                 "of layers; no pipeline plan can be derived")
    try:
        meta = meta_copy(model)
    except Exception as e:  # noqa: BLE001
        return DerivedPP(refusal=f"{name} declares no pipeline plan and cannot be built on the meta device to "
                                 f"derive one ({type(e).__name__})")
    # the modules at the blocks' level: children of the blocks' ancestors, not ancestors themselves
    ancestors = {""}
    for b in blocks:
        parts = b.split(".")
        ancestors.update(".".join(parts[:i]) for i in range(1, len(parts)))
    candidates = [path for path, _ in meta.named_modules()
                  if path and path not in ancestors and path.rpartition(".")[0] in ancestors
                  and any(True for _ in meta.get_submodule(path).parameters())]
    owned = {id(p) for c in candidates for p in meta.get_submodule(c).parameters()}
    loose = [n for n, p in meta.named_parameters(remove_duplicate=False) if id(p) not in owned]
    if loose:
        return DerivedPP(refusal=f"{name} declares no pipeline plan, and its parameter {loose[0]!r} lies outside "
                                 "every module a derived plan could cut at")
    order: list[str] = []
    inputs: dict[str, list[torch.Tensor | None]] = {c: [] for c in candidates}
    outputs: dict[str, object] = {}
    handles = [meta.get_submodule(c).register_forward_pre_hook(
        lambda _m, args, kwargs, c=c: (order.append(c), inputs[c].append(_first_tensor(args, kwargs)))[0],
        with_kwargs=True) for c in candidates]
    handles += [meta.get_submodule(c).register_forward_hook(
        lambda _m, _args, out, c=c: outputs.__setitem__(c, out)) for c in candidates]
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")

    def reset() -> None:  # a failed attempt may have called some modules: record the last one only
        order.clear()
        for seen in inputs.values():
            seen.clear()

    try:
        with torch.enable_grad(), shape_only(meta, experts):
            out, _ = meta_forward(meta, ids, before=reset)
    except Exception as e:  # noqa: BLE001 - whatever the model's own forward raises on meta tensors
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return DerivedPP(refusal=f"{name} declares no pipeline plan, and its forward failed on the meta device "
                                 f"({type(e).__name__}: {text[:120]}), so none can be derived")
    finally:
        for h in handles:
            h.remove()
    twice = [c for c in candidates if len(inputs[c]) > 1]
    never = [c for c in candidates if not inputs[c]]
    if twice or never:
        what = f"calls {twice[0]!r} more than once" if twice else f"never calls {never[0]!r}"
        return DerivedPP(refusal=f"{name} declares no pipeline plan, and its forward {what}, so it cannot be cut "
                                 "into stages")
    layers = tuple(order)
    logits = next((v for v in (getattr(out, k, None) for k in ("logits", "last_hidden_state"))
                   if isinstance(v, torch.Tensor)), None)
    if logits is None or logits.grad_fn is None:
        return DerivedPP(refusal=f"{name} declares no pipeline plan, and its output does not depend on its "
                                 "parameters on the meta device; none can be derived")
    starts = allowed_starts(meta, layers, [inputs[c][0] for c in layers], logits)
    tuple_out = tuple((c, len(o)) for c, o in outputs.items() if isinstance(o, tuple))
    return DerivedPP(layers=layers, starts=starts, tuple_out=tuple_out)


def encoder_stack(model: nn.Module, blocks: tuple[str, ...]) -> tuple[str, ...]:
    """An encoder's blocks (``_no_split_modules``) include its embeddings (BERT's ``BertEmbeddings``)
    beside its layers: the blocks lying in a ``ModuleList`` when they all lie in one (the embeddings
    are then one of the modules before them), else ``blocks`` unchanged (refused as not one list)."""
    listed = [b for b in blocks if isinstance(model.get_submodule(b.rpartition(".")[0]) if "." in b else model,
                                              (nn.ModuleList, nn.Sequential))]
    return tuple(listed) if listed and len({b.rpartition(".")[0] for b in listed}) == 1 else blocks


def allowed_starts(model: nn.Module, layers: Sequence[str], entering: Sequence[torch.Tensor | None],
                   output: torch.Tensor) -> tuple[int, ...]:
    """Indices of ``layers`` at which a stage may start: 0, and every ``i`` such that no parameter of
    ``layers[:i]`` (not also in ``layers[i:]``) reaches ``output``'s autograd graph except through
    ``entering[i]``, the tensor layer ``i`` was called with."""
    params_of = [{id(p) for p in model.get_submodule(path).parameters()} for path in layers]
    starts = [0]
    for i in range(1, len(layers)):
        x = entering[i]
        if x is None or not x.is_floating_point():
            continue
        earlier = set().union(*params_of[:i]) - set().union(*params_of[i:])
        stop = x.grad_fn
        seen: set[int] = set()
        stack = [output.grad_fn]
        leak = False
        while stack and not leak:
            node = stack.pop()
            if node is None or id(node) in seen or node is stop:
                continue
            seen.add(id(node))
            var = getattr(node, "variable", None)
            if var is not None and id(var) in earlier:
                leak = True
            stack.extend(n for n, _ in node.next_functions)
        if not leak and stop is not None:
            starts.append(i)
    return tuple(starts)
