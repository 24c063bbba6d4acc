"""Pipeline stages of a Hugging Face model run the model's own forward.

A pipeline plan (``_pp_plan`` / ``base_model_pp_plan``, read by ``hf.plan.hf_layers``, or for a model
declaring none the plan ``hf.pp_derive`` reads off its forward, with the layers a stage may start at)
says where a model may be cut, not what happens between and around those modules. The model's ``forward`` builds
the attention masks (causal, sliding-window, per-layer mask types such as Gemma-2/3's alternating
sliding/full layers), the position ids and rotary tables, scales embeddings, applies the final norm
and soft-caps logits. Calling the layers one after another with hidden states alone loses all of it
(eager attention without its mask is not even causal), so a stage runs that ``forward`` itself:

- on a *shell* of the model: shallow copies of the containers above the plan's layers (the model,
  its base model, the ``layers`` list), sharing every parameter, buffer and other submodule with the
  real model, in which each layer of the plan is replaced by what this stage does with it:
  * a layer of an earlier stage hands its input on unchanged (``_Skip``; nothing of it runs; one
    called with something other than the activation, such as GPT-2's position embedding, gives 0;
    an encoder's embeddings module, called by keyword with ``inputs_embeds``, hands that on),
  * this stage's first layer gets the activation the previous stage sent instead of whatever the
    forward computed up to it (``_Enter``),
  * this stage's layers are the real modules (as wrapped by TP, checkpointing, compile, FSDP),
  * the first layer of the next stage ends the forward (``_Leave``): the tensor it was called with
    is this stage's output, so whatever the forward does between two layers belongs to the stage
    before the cut (Gemma's embedding scaling runs on the stage holding the embedding);
- the first stage calls ``forward(input_ids=...)``, every later one ``forward(inputs_embeds=...)``
  with the received activation (for shapes, dtype and device: masks and positions are then built by
  the model's own code exactly as for the whole model, and its first layers are skipped); the last
  stage returns the output's ``logits``.

Nothing is re-implemented: masks come from ``transformers.masking_utils`` as the model calls it,
rotary tables from the model's own ``rotary_emb``, soft-capping from its head's forward. The shell
is rebuilt at every call (a handful of dict copies), so modules wrapped after the cut are used.

``check_hf_pipeline`` runs every cut of a meta-device copy of the model before any process starts
and refuses, in one line, a model this cannot run: a forward that does not call the plan's layers
once each, in order, with the hidden states first; one that reads a layer's attributes this rank
would not have; one without ``inputs_embeds``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lightning_par.parallel.hf.plan import find_hf_model
from lightning_par.parallel.hf.pp_derive import meta_copy, meta_forward, shape_only


class _StageOutput(Exception):  # noqa: N818 - control flow, not an error
    """Raised by ``_Leave``: the forward has reached the next stage's first layer."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def _hidden(args: tuple, kwargs: dict) -> Any:
    """The hidden states a layer is called with: its first argument (positional or by name)."""
    if args:
        return args[0]
    for key in ("hidden_states", "input", "x"):
        if key in kwargs:
            return kwargs[key]
    raise TypeError("pipeline stage: a layer of the plan was called without hidden states")


def _hidden_or_none(args: tuple, kwargs: dict) -> Any:
    """``_hidden``, or None for a layer called without hidden states (an encoder's embeddings, called with
    the input ids by keyword: only the first layer may be, as no stage enters there)."""
    try:
        return _hidden(args, kwargs)
    except TypeError:
        return None


def _with_hidden(args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (x, *args[1:]), kwargs
    key = next(k for k in ("hidden_states", "input", "x") if k in kwargs)
    return args, {**kwargs, key: x}


class _StandIn(nn.Module):
    """A layer of the plan inside a stage's shell. Attributes the forward reads from the layer
    (e.g. ``attention_type``) come from the layer it stands for (``RemoteLayer`` keeps them)."""

    def __init__(self, path: str, real: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_lp_path", path)
        object.__setattr__(self, "_lp_real", real)  # not a submodule: the shell owns no parameters

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            real = self.__dict__.get("_lp_real")
            if real is None:
                raise
            return getattr(real, name)


class _Skip(_StandIn):
    """A layer of an earlier stage: hands its hidden states on. A layer called with something else
    than a tensor shaped like the activation this stage received (GPT-2's ``wpe`` and OPT's
    ``embed_positions`` take position ids or a mask, and their output is added to the embeddings)
    gives a zero scalar instead, which adds to anything: the value is replaced by the received
    activation at this stage's first layer anyway (``_Enter``). An encoder's embeddings module
    (BERT's, called as ``embeddings(input_ids=None, ..., inputs_embeds=x)``) hands on ``x``, the
    activation this stage was given: the forward builds the attention mask from it."""

    def __init__(self, path: str, real: nn.Module, x: torch.Tensor, tuple_len: int = 0) -> None:
        super().__init__(path, real)
        object.__setattr__(self, "_lp_shape", tuple(x.shape))
        object.__setattr__(self, "_lp_dtype", x.dtype if x.is_floating_point() else torch.get_default_dtype())
        object.__setattr__(self, "_lp_tuple", tuple_len)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not args and not any(k in kwargs for k in ("hidden_states", "input", "x")) \
                and isinstance(kwargs.get("inputs_embeds"), torch.Tensor):
            # an encoder's embeddings module, called by keyword (BERT's ``embeddings(input_ids=None, ...,
            # inputs_embeds=...)``): it hands on the activation this stage was given as ``inputs_embeds``
            h = kwargs["inputs_embeds"]
        else:
            h = _hidden(args, kwargs)
        if isinstance(h, torch.Tensor) and tuple(h.shape) != self.__dict__["_lp_shape"]:
            h = torch.zeros((), dtype=self.__dict__["_lp_dtype"], device=h.device)
        n = self.__dict__["_lp_tuple"]  # the real layer returns a tuple (hidden states first): so does this
        return (h, *([None] * (n - 1))) if n else h


class _Leave(_StandIn):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _StageOutput(_hidden(args, kwargs))


class _Enter(_StandIn):
    def __init__(self, path: str, real: nn.Module, x: torch.Tensor) -> None:
        super().__init__(path, real)
        object.__setattr__(self, "_lp_x", x)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _with_hidden(args, kwargs, self.__dict__["_lp_x"])
        return self.__dict__["_lp_real"](*args, **kwargs)


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing everything but its own table of children."""
    shell = copy.copy(module)
    shell.__dict__["_modules"] = dict(module._modules)
    shell.__dict__["_lp_shell"] = True
    return shell


def _shell(hf: nn.Module, replacements: dict[str, nn.Module]) -> nn.Module:
    """``hf`` with the modules at ``replacements``' paths (relative to it) replaced, the model untouched."""
    root = _shallow(hf)
    for path, new in replacements.items():
        *parents, leaf = path.split(".")
        node = root
        for name in parents:
            child = node._modules[name]
            if not child.__dict__.get("_lp_shell", False):
                child = _shallow(child)
                node._modules[name] = child
            node = child
        node._modules[leaf] = new
    return root


def _logits(out: Any) -> torch.Tensor:
    """What the whole model's caller uses of its output: the logits (or the last hidden state)."""
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


class HFStageRunner:
    """Runs one pipeline stage (layers ``start .. end-1`` of the plan) through the model's own forward.

    ``root`` is the module the plan's paths are relative to (the LightningModule); ``hf_path`` the
    Hugging Face model's path in it. ``layer_of(path)`` gives the module this stage runs for one of its
    layers (the stage module's, possibly wrapped); the other layers are stand-ins (module docstring).
    """

    def __init__(self, root: nn.Module, hf_path: str, layers: Sequence[str], start: int, end: int) -> None:
        self._root = weakref.ref(root)  # a stage module must not own (or deep-copy) the whole model
        self.hf_path = hf_path
        self.layers, self.start, self.end = list(layers), start, end
        cut = len(hf_path) + 1 if hf_path else 0
        self.rel = [p[cut:] for p in self.layers]
        hf = root.get_submodule(hf_path) if hf_path else root
        self.tuple_out = _tuple_outputs(hf)

    def __repr__(self) -> str:
        return f"HFStageRunner(layers {self.start}..{self.end - 1} of {len(self.layers)})"

    def forward_keywords(self) -> set[str]:
        """What the model's forward takes by keyword beside what the stage passes itself (``"*"``: it takes
        ``**kwargs``, anything)."""
        root = self._root()
        hf = root.get_submodule(self.hf_path) if root is not None and self.hf_path else root
        params = inspect.signature(hf.forward).parameters if hf is not None else {}
        names = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        names -= {"input_ids", "inputs_embeds", "use_cache", "labels", "past_key_values"}
        return names | ({"*"} if any(p.kind is p.VAR_KEYWORD for p in params.values()) else set())

    def __call__(self, x: torch.Tensor, layer_of: Callable[[str], nn.Module], **forward_kwargs: Any) -> torch.Tensor:
        root = self._root()
        if root is None:
            raise RuntimeError("pipeline stage: the model this stage was cut from no longer exists")
        hf = root.get_submodule(self.hf_path) if self.hf_path else root
        real = {p: root.get_submodule(p) for p in self.layers}  # RemoteLayers off this rank
        replacements: dict[str, nn.Module] = {}
        for i, (path, rel) in enumerate(zip(self.layers, self.rel)):
            if i < self.start:
                replacements[rel] = _Skip(path, real[path], x, self.tuple_out.get(rel, 0))
            elif i == self.start and self.start > 0:
                replacements[rel] = _Enter(path, layer_of(path), x)
            elif i < self.end:
                replacements[rel] = layer_of(path)
            else:
                replacements[rel] = _Leave(path, real[path])
        shell = _shell(hf, replacements)
        inputs = {"input_ids": x} if self.start == 0 else {"inputs_embeds": x.detach()}
        try:
            out = shell(**inputs, use_cache=False, **forward_kwargs)
        except _StageOutput as stop:
            return stop.hidden
        if self.end < len(self.layers):
            raise RuntimeError("pipeline stage: the model's forward returned without calling "
                               f"{self.layers[self.end]!r}")
        return _logits(out)


def _tuple_outputs(hf: nn.Module) -> dict[str, int]:
    """The layers of a derived pipeline plan (``hf.pp_derive``) returning a tuple, and its length; a
    declared plan's layers return tensors."""
    if getattr(getattr(hf, "config", None), "base_model_pp_plan", None):
        return {}
    from lightning_par.parallel.hf.plan import hf_derived_pp

    return dict(hf_derived_pp(hf).tuple_out)


def hf_stage_runner(model: nn.Module, layers: Sequence[str], start: int, end: int) -> HFStageRunner | None:
    """A runner for stage ``layers[start:end]`` of ``model`` when the plan's layers all lie inside one
    Hugging Face model; None for other models (their stages call the layers one after another)."""
    found = find_hf_model(model)
    if found is None:
        return None
    path, _ = found
    if path and not all(p.startswith(path + ".") for p in layers):
        return None
    return HFStageRunner(model, path, layers, start, end)


# ---------------------------------------------------------------------------------------------
# Before launch


def _meta_model(hf: nn.Module) -> nn.Module:
    """``hf`` itself when it is all on the meta device (as before launch), else a fresh meta-device
    model of its class and config (the real one may be large, or already cut)."""
    return meta_copy(hf)


@contextlib.contextmanager
def _shape_only_experts(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s routed-expert modules return zeros shaped like their input: routing
    reads values (which experts got tokens) that meta tensors lack, and the check is about the calls
    and what crosses a cut, which the experts do not change."""
    from lightning_par.parallel.hf.plan import hf_experts

    with shape_only(model, hf_experts(model)[0]):
        yield


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def check_hf_pipeline(model: nn.Module, layers: Sequence[str], seq_len: int = 8, starts: Sequence[int] = ()) -> None:
    """Refuse, with a one-line ``ValueError``, a Hugging Face model whose own forward cannot run as
    pipeline stages cut at ``layers`` (see the module docstring); nothing for other models.

    Every parameter of the model must lie in one of ``layers`` (a parameter outside them would be
    replicated on every stage and trained on one). On the meta device: the whole forward must call
    the plan's layers once each, in plan order, each with a tensor of hidden states first; then
    every stage of the finest cut (one layer per stage, or one stage from each of ``starts`` to the
    next: ``ParallelPlan.stage_starts``) runs through ``HFStageRunner`` as a pipeline rank would (a
    stage's output must be one tensor). Meta tensors have no values, and building a mask reads some
    (transformers looks for packed sequences), so these runs pass an explicit mask
    (``hf.pp_derive.meta_mask_options``): what is checked is the order of calls and what crosses a
    cut, not the mask (each stage builds that with the model's own code).
    """
    found = find_hf_model(model)
    if found is None:
        return
    path, hf = found
    name = type(hf).__name__
    outside = [p for p in layers if path and not p.startswith(path + ".")]
    if outside:
        raise ValueError(f"pipeline: the stages of {name} run its own forward, but the pipeline layer "
                         f"{outside[0]!r} lies outside it; cut only inside {path}")
    cut = len(path) + 1 if path else 0
    rel = [p[cut:] for p in layers]
    if "inputs_embeds" not in inspect.signature(type(hf).forward).parameters:
        raise ValueError(f"pipeline: {name}.forward takes no inputs_embeds, which every stage after the first "
                         "needs; this model cannot be cut into pipeline stages")
    meta = _meta_model(hf)
    for r in rel:
        try:
            meta.get_submodule(r)
        except AttributeError:
            raise ValueError(f"pipeline: {name} has no module {r!r}, which its pipeline plan names") from None
    covered = {id(p) for r in rel for p in meta.get_submodule(r).parameters()}
    loose = [n for n, p in meta.named_parameters(remove_duplicate=False) if id(p) not in covered]
    if loose:
        raise ValueError(f"pipeline: {name}'s parameter {loose[0]!r} lies in no layer of its pipeline plan, so it "
                         "would be replicated on every stage and trained on one; it cannot be cut into stages")
    with _shape_only_experts(meta):
        _check_on_meta(meta, name, rel, seq_len, starts)


def _check_on_meta(meta: nn.Module, name: str, rel: list[str], seq_len: int, starts: Sequence[int] = ()) -> None:
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    calls: list[int] = []
    handles = [meta.get_submodule(r).register_forward_pre_hook(
        lambda _m, args, kwargs, i=i: calls.append(i if i == 0 or isinstance(_hidden_or_none(args, kwargs),
                                                                               torch.Tensor) else -1),
        with_kwargs=True) for i, r in enumerate(rel)]
    try:
        with torch.no_grad():
            _, option = meta_forward(meta, ids, before=calls.clear)
    except Exception as e:  # noqa: BLE001 - whatever the model's own forward raises on meta tensors
        raise ValueError(f"pipeline: {name}'s forward failed on the meta device ({_first_line(e)}); "
                         "it cannot be checked for pipeline stages") from None
    finally:
        for h in handles:
            h.remove()
    if calls != list(range(len(rel))):
        raise ValueError(f"pipeline: {name}'s forward does not call the layers of its pipeline plan once each, in "
                         f"plan order, with hidden states first (calls: {calls}); it cannot be cut into stages")
    edges = [*(sorted(starts) if starts else range(len(rel))), len(rel)]
    hidden: Any = ids
    for a, b in zip(edges, edges[1:]):
        try:
            with torch.no_grad():
                hidden = HFStageRunner(meta, "", rel, a, b)(hidden, meta.get_submodule, **option)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"pipeline: a stage of {name} starting at {rel[a]!r} cannot run through its own "
                             f"forward ({_first_line(e)})") from None
        if not isinstance(hidden, torch.Tensor):
            raise ValueError(f"pipeline: a stage of {name} ending before {rel[b]!r} does not end in one tensor")
