"""Tensor parallelism (Megatron-style column/row splits, optional sequence parallelism) on DTensor.

A model declares a plan: module path pattern (``*`` matches one path component) -> style name.
``apply_tensor_parallel`` turns the names into DTensor ``ParallelStyle`` objects and applies them
with ``parallelize_module`` on a 1-D tensor-parallel mesh. The math, for a pair of linears
``Y = f(X A) B`` (attention q/k/v -> o, MLP fc -> proj):

- ``colwise``: ``A = [A_1 ... A_p]`` split by output columns; rank r computes ``f(X A_r)`` from the
  full (replicated) ``X``. Attention reads its local head count from the shapes, so a column split
  of q/k/v is a split of the heads.
- ``rowwise``: ``B`` split by input rows to match; rank r computes the partial sum ``f(X A_r) B_r``
  and one all-reduce (or, under sequence parallelism, one reduce-scatter) adds them up.
- ``embedding``: the token table split by vocabulary rows; each rank looks up the ids it owns
  (zeros elsewhere) and the partial results are all-reduced (reduce-scattered under SP).
- ``output``: the LM head, split by vocabulary columns; the logits are gathered (replicated)
  unless ``loss_parallel``, in which case they stay a DTensor sharded on the vocabulary dim for
  ``torch.distributed.tensor.parallel.loss_parallel`` (cross-entropy without the gather).
- ``sequence_parallel``: only with ``sequence_parallel=True`` (skipped otherwise): the LayerNorms
  between the splits run on a sequence shard (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models"). Between blocks the activations are then local
  tensors holding this rank's slice of the sequence (dim 1); the module owning each colwise group
  (``attn``, ``mlp``) all-gathers its input first (``PrepareModuleInput``, as torchtitan's llama
  ``parallelize`` does) and the rowwise linear reduce-scatters back onto the sequence shard.
- ``position``: a table of positions (``(T, C)`` lookup), weights replicated as DTensors; its
  output is replicated, or under SP cut to this rank's sequence slice so it adds to the
  sequence-sharded token embeddings. Under SP every ``nn.Embedding`` that sits next to an
  ``embedding`` entry and is not named in the plan (the GPT's ``embed.pos``) gets this style
  automatically.

Without SP the modules the plan leaves alone (LayerNorms, the position table) get their
parameters replicated as DTensors (``replicate``; their inputs and outputs stay replicated local
tensors, nothing is communicated in forward). Either way every parameter of a GPT ends up a
DTensor, which torch's ``clip_grad_norm_`` needs. Parameters are taken from tensor-parallel rank 0
(``src_data_rank=0``), so the ranks' initial values need not agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
import logging
from fnmatch import fnmatchcase
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel as _torch_loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from lightning_par.parallel.adapters.lora import LoRALinear, lora_placements
from lightning_par.parallel.init.ties import retie, tied_parameters
from lightning_par.parallel.memory.chunked_loss import ChunkedHead, ShardVocab
from lightning_par.parallel.precision.float8 import float8_tp_style
from lightning_par.parallel.tensor.tp_styles import (
    _LOCAL_KINDS,
    PARAM_STYLES,
    STYLES,
    LocalParallel,
    param_placement,
    parse_style,
    shard_param,
)

log = logging.getLogger(__name__)

def check_tp_divisible(tp: int, divisible: dict[str, int]) -> None:
    """Raise ``ValueError`` (one line) if ``tp`` does not divide one of the named sizes."""
    if tp < 1:
        raise ValueError(f"tensor-parallel degree must be a positive integer, got tp={tp}")
    for name, size in divisible.items():
        if size % tp:
            raise ValueError(f"tensor-parallel degree tp={tp} does not divide {name}={size}; "
                             f"choose a tp that divides it")


def check_sequence_parallel(plan: dict[str, str]) -> None:
    """Raise ``ValueError`` (one line) if ``plan`` cannot run sequence parallelism: SP shards the norms
    between the splits, so the plan must name them (``sequence_parallel`` entries). Hugging Face
    plans name none (their norms and rotary positions would see a sequence shard)."""
    if "sequence_parallel" not in plan.values():
        raise ValueError("sequence_parallel needs a tp_plan naming the norms between the splits ('sequence_parallel' "
                         "entries); this model's plan names none -- set sequence_parallel=false")


def match_modules(model: nn.Module, pattern: str) -> list[str]:
    """Paths of the submodules of ``model`` matching ``pattern`` (``*`` = one path component)."""
    want = pattern.split(".")
    found = []
    for name, _ in model.named_modules():
        parts = name.split(".") if name else []
        if len(parts) == len(want) and all(fnmatchcase(p, w) for p, w in zip(parts, want)):
            found.append(name)
    return found


class ReplicateParallel(ParallelStyle):
    """Styles ``replicate``/``position``: replicate a module's parameters as DTensors (inputs are taken
    as replicated); hand back its output replicated, or (when
    ``shard_dim`` is given) this rank's slice of it along ``shard_dim`` (negative dims count from the
    end). Gradients of the replicated parameters are all-reduced by DTensor."""

    def __init__(self, *, shard_dim: int | None = None) -> None:
        super().__init__()
        self.shard_dim = shard_dim

    def _replicate(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):  # split already by a parameter entry of the plan
                continue
            dt = distribute_tensor(param, mesh, [Replicate()], src_data_rank=self.src_data_rank)
            module.register_parameter(p_name, nn.Parameter(dt, requires_grad=param.requires_grad))

    @staticmethod
    def _inputs(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    @staticmethod
    def _output(shard_dim: int | None, mod: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        if isinstance(out, (tuple, list)):  # a router's (logits, weights, indices)
            return type(out)(ReplicateParallel._output(shard_dim, mod, o, mesh) for o in out)
        if not isinstance(out, DTensor):
            return out
        if shard_dim is not None:
            out = out.redistribute(placements=[Shard(shard_dim % out.ndim)])
        return out.to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate, self._inputs,
                                 partial(self._output, self.shard_dim))


class LocalHeadsReplicate(ReplicateParallel):
    """Style ``replicate_local_heads`` (transformers' ``replicated_with_grad_allreduce``): a module with
    replicated parameters (a per-head q/k norm) applied to this rank's heads, ``(..., heads, head_dim)``
    after a colwise split. Its input is read as sharded on the heads dim, so the parameters' gradient
    -- a sum over this rank's heads only -- is all-reduced over the tensor-parallel ranks by DTensor;
    the output is this rank's heads again."""

    @staticmethod
    def _inputs(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(x, mesh, [Shard(x.ndim - 2)], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.ndim >= 3 else x
                     for x in inputs)


class ReplicatedSequenceParallel(SequenceParallel):
    """torch's ``SequenceParallel``, but its replicated parameters are broadcast from tensor-parallel
    rank 0 (torch's version assumes every rank already holds identical LayerNorm weights)."""

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for p_name, param in list(module.named_parameters(recurse=False)):
            dt = distribute_tensor(param, device_mesh, [Replicate()], src_data_rank=self.src_data_rank)
            module.register_parameter(p_name, nn.Parameter(dt, requires_grad=param.requires_grad))


class OwnedRowwiseParallel(RowwiseParallel):
    """torch's ``RowwiseParallel`` whose local output is a tensor of its own. torch's ``to_local`` hands
    out a view made inside an autograd Function, and autograd forbids modifying such a view in place;
    decoder layers do exactly that to a row-split projection's output (Falcon's
    ``mlp_output += attention_output``, Llama-4's residual add). One copy of the reduced output, no
    extra memory held: the reduced tensor it copies is freed at once."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001, ANN205
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return out.clone() if use_local_output and not isinstance(out, DTensor) else out


def _lora_partition(kind: str, src_data_rank: int | None, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Split a LoRA layer's own parameters and its adapters' (``lora.lora_placements``). torch's styles take
    ``module.named_parameters()`` recursively and register the dotted names (``lora_A.weight``) on the layer,
    which ``nn.Module`` refuses, and would split both adapters like the base weight."""
    for p_name, param in list(module.named_parameters(recurse=False)):
        placements = lora_placements(module, p_name, kind)
        if placements is None or isinstance(param, DTensor):
            continue
        dt = distribute_tensor(param, mesh, placements, src_data_rank=src_data_rank)
        module.register_parameter(p_name, nn.Parameter(dt, requires_grad=param.requires_grad))


class LoRAColwiseParallel(ColwiseParallel):
    """``colwise`` on a LoRA layer: ``W`` and ``B`` split by output rows, ``A`` replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):  # noqa: ANN001, ANN202
        _lora_partition("colwise", self.src_data_rank, name, module, device_mesh)


class LoRARowwiseParallel(OwnedRowwiseParallel):
    """``rowwise`` on a LoRA layer: ``W`` and ``A`` split by input columns, ``B`` and the bias replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):  # noqa: ANN001, ANN202
        _lora_partition("rowwise", self.src_data_rank, name, module, device_mesh)


def _style(name: str, *, sp: bool, loss_parallel: bool, module: nn.Module | None = None) -> ParallelStyle | ShardVocab | None:
    seq = Shard(1)  # (B, T, C): the sequence dim
    base, arg = parse_style(name)
    if base in _LOCAL_KINDS or (base in ("colwise", "rowwise") and module is not None
                                and not isinstance(module, (nn.Linear, nn.Embedding))):
        # torch's Colwise/RowwiseParallel take only nn.Linear and nn.Embedding (transformers' Conv1D is
        # neither), and no torch style splits a packed weight per part or runs experts on local shards
        if sp and base not in ("local_params", "divide_attrs"):
            raise ValueError(f"tensor-parallel style {name!r} does not run under sequence parallelism; "
                             "set sequence_parallel=false")
        return LocalParallel(base, arg)
    if isinstance(module, LoRALinear) and name not in ("colwise", "rowwise", "replicate"):
        raise ValueError(f"lora: a tensor-parallel {name!r} layer cannot carry adapters; leave it out of lora.targets")
    if isinstance(module, LoRALinear) and name in ("colwise", "rowwise"):
        return (LoRAColwiseParallel() if name == "colwise"
                else LoRARowwiseParallel(output_layouts=seq) if sp else LoRARowwiseParallel())
    if module is not None and (f8 := float8_tp_style(name, module, output_layouts=seq if sp else None)) is not None:
        return f8  # a float8 layer (model.float8=tensorwise): torchao's styles, its gathers in float8
    if name == "colwise":
        return ColwiseParallel()  # under SP the owning module all-gathers the input (see below)
    if name == "rowwise":
        return OwnedRowwiseParallel(output_layouts=seq) if sp else OwnedRowwiseParallel()
    if name == "embedding":
        return OwnedRowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp else Replicate())
    if name == "output" and isinstance(module, ChunkedHead):
        return ShardVocab(sequence_parallel=sp)  # the loss projects chunk by chunk, vocabulary-parallel
    if name == "output":
        return ColwiseParallel(input_layouts=seq if sp else Replicate(),
                               output_layouts=Shard(-1) if loss_parallel else Replicate(),
                               use_local_output=not loss_parallel)
    if name == "sequence_parallel":
        return ReplicatedSequenceParallel() if sp else None
    if name == "replicate":
        return ReplicateParallel()
    if name == "colwise_gather":
        return ColwiseParallel(input_layouts=seq if sp else Replicate(), output_layouts=Replicate())
    if name == "rowwise_split":  # a replicated input, split locally (no communication) to match the rows
        return OwnedRowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp else Replicate())
    if name == "embedding_colwise":  # ColwiseParallel on an nn.Embedding splits the hidden columns
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp else Replicate())
    if name == "replicate_local_heads":
        return LocalHeadsReplicate()
    if name == "position":
        return ReplicateParallel(shard_dim=-2 if sp else None)  # (T, C) or (B, T, C): T is dim -2
    raise ValueError(f"unknown tensor-parallel style {name!r}; expected one of {', '.join(STYLES)}")


def apply_tensor_parallel(
    model: nn.Module,
    *,
    tp_mesh: DeviceMesh,
    plan: dict[str, str] | None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    divisible: dict[str, int] | None = None,
    strict: bool = True,
    replicate_rest: bool = True,
    keep_plain: Sequence[str] = (),
) -> dict[str, str]:
    """Apply ``plan`` (path pattern -> style name, see the module docstring) to ``model`` in place.

    Args:
        tp_mesh: 1-D tensor-parallel mesh (``mesh["tp"]``).
        sequence_parallel: shard LayerNorms and the activations between blocks on the sequence dim.
        loss_parallel: keep the ``output`` logits sharded on the vocabulary dim (a DTensor); compute
            the loss and its backward under :func:`loss_parallel_context`.
        divisible: sizes ``tp`` must divide (the model plan's ``tp_divisible``), checked first.
        strict: every pattern must match a module. Pipeline stages hold part of a model, so
            callers applying a whole-model plan to one stage pass ``strict=False``.
        replicate_rest: without SP, turn the parameters the plan leaves plain (LayerNorms, position
            table) into replicated DTensors (style ``replicate``: inputs and outputs stay replicated
            local tensors, no communication), so every parameter is a DTensor: torch's
            ``clip_grad_norm_`` and optimizers' foreach paths refuse a mix of Tensors and DTensors.
        keep_plain: module paths left as they are (an MoE layer's experts, which expert parallelism
            turns into DTensors on its own ``ep`` axis).

    Returns the applied plan: concrete module path -> style name (skipped entries left out).
    """
    if not plan:
        raise ValueError("tensor parallelism needs a plan, but the model's tp_plan is empty; "
                         "declare one in the model's parallel_plan() or turn tp off")
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D tensor-parallel mesh, got {tp_mesh.ndim}-D; "
                         "pass mesh['tp']")
    check_tp_divisible(tp_mesh.size(), divisible or {})
    if sequence_parallel:
        check_sequence_parallel(plan)

    def kept(path: str) -> bool:  # left to expert parallelism: TP and EP never both split the experts
        return any(path == k or path.startswith(k + ".") for k in keep_plain)

    applied: dict[str, str] = {}
    param_entries: dict[str, str] = {}  # "module.path.param" -> style (transformers' stacked expert weights)
    for pattern, style in plan.items():
        base, _ = parse_style(style)  # validates the name
        paths = match_modules(model, pattern)
        owner_pattern, _, leaf = pattern.rpartition(".")
        params = [] if paths else [f"{o}.{leaf}" if o else leaf for o in match_modules(model, owner_pattern)
                                   if isinstance((model.get_submodule(o) if o else model)._parameters.get(leaf),
                                                 nn.Parameter)]
        if params and base not in PARAM_STYLES:
            raise ValueError(f"tensor-parallel plan entry {pattern!r} names a parameter, but style {style!r} splits "
                             f"modules (a parameter takes {', '.join(PARAM_STYLES)})")
        if not paths and not params and strict:
            raise ValueError(f"tensor-parallel plan entry {pattern!r} matches no module of {type(model).__name__}")
        if style == "sequence_parallel" and not sequence_parallel:
            continue
        applied.update((p, style) for p in paths if not kept(p))
        param_entries.update((p, style) for p in params if not kept(p))

    if sequence_parallel:
        # position tables beside a vocabulary-split embedding must follow it onto the sequence shard
        for path in [p for p, s in applied.items() if s == "embedding"]:
            parent = path.rpartition(".")[0]
            owner = model.get_submodule(parent)
            for child_name, child in owner.named_children():
                child_path = f"{parent}.{child_name}" if parent else child_name
                if isinstance(child, nn.Embedding) and child_path not in applied:
                    applied[child_path] = "position"
                    log.info("tensor parallel: %s treated as a position table (replicated, sequence-sliced)",
                             child_path)

    ties = tied_parameters(model)  # one weight used by two modules (tied input/output embeddings)
    for path, name in param_entries.items():  # split first: the owner's style then runs on the shards
        owner, _, leaf = path.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        shard_param(module, leaf, param_placement(name, module._parameters[leaf]), tp_mesh, path)
        applied[path] = name
    param_paths = set(param_entries)

    styles: dict[str, ParallelStyle] = {}
    for path, name in applied.items():
        if path in param_paths:
            continue
        style = _style(name, sp=sequence_parallel, loss_parallel=loss_parallel,
                       module=model.get_submodule(path) if path else model)
        assert style is not None
        styles[path] = style
    if sequence_parallel:
        # the module owning each colwise group receives the sequence shard and all-gathers it once
        for owner in dict.fromkeys(p.rpartition(".")[0] for p, s in applied.items() if s == "colwise"):
            styles[owner] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

    for path, style in styles.items():
        if isinstance(style, ShardVocab):  # a chunked output layer: split without hooks (memory/chunked_loss.py)
            style.apply(model.get_submodule(path), tp_mesh, path)
            continue
        parallelize_module(model.get_submodule(path) if path else model, tp_mesh, style)

    # modules still holding plain parameters: replicate leaf modules (exact when their inputs are
    # replicated, which holds everywhere outside the colwise->rowwise pairs without SP)
    plain = [(path, m) for path, m in model.named_modules()
             if path not in keep_plain and any(not isinstance(p, DTensor) for p in m.parameters(recurse=False))]
    for path, module in plain:
        leaf = not any(True for c in module.children() for _ in c.parameters())
        if replicate_rest and not sequence_parallel and leaf:
            parallelize_module(module, tp_mesh, ReplicateParallel())
            applied[path] = "replicate"
        else:
            log.warning("tensor parallel: %s keeps plain (non-DTensor) parameters", path or type(model).__name__)
    # after the replication: a tied pair the plan leaves alone (a declared plan naming neither the embedding nor
    # the head) was replicated one module at a time, two parameters that would be initialised and trained apart
    _retie_split(model, ties)
    log.info("tensor parallel: tp=%d, %d modules (%s), sequence_parallel=%s, loss_parallel=%s",
             tp_mesh.size(), len(applied), ", ".join(sorted(set(applied.values()))), sequence_parallel,
             loss_parallel)
    return applied


def reduce_partial_gradients(params: Iterable[torch.Tensor]) -> None:
    """After backward under sequence parallelism: a replicated parameter that saw only its rank's
    sequence shard (a LayerNorm's) holds a ``Partial`` DTensor gradient, and DTensor all-reduces it
    again in every op that reads it (torch's foreach AdamW reads it three times, a norm check once
    more). Reduce each once, here: one all-reduce per such parameter per optimizer step."""
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            param.grad = grad.redistribute(grad.device_mesh, param.placements)


def _retie_split(model: nn.Module, ties: list[tuple[str, str]]) -> None:
    """Each style replaced its module's parameters with a DTensor of its own, so a shared weight is now
    two. Where both uses split it the same way (the vocabulary-split embedding and LM head are both
    ``Shard(0)`` of the ``(vocab, hidden)`` table, as in Megatron-LM), the second use takes the first's
    DTensor again: one parameter, its gradient the sum of both uses. Otherwise one line: two copies
    would train apart."""
    for src, dst in ties:
        a, b = model.get_parameter(src), model.get_parameter(dst)
        if a is b:
            continue
        place = [tuple(x.placements) if isinstance(x, DTensor) else "plain" for x in (a, b)]
        if place[0] != place[1] or a.shape != b.shape:
            raise ValueError(f"{src} and {dst} share one weight, but tensor parallelism splits them differently "
                             f"({place[0]} vs {place[1]}); split both uses alike in the tp_plan or use tp=1")
        retie(model, [(src, dst)])


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """``torch``'s ``loss_parallel()`` when enabled, else a no-op; wrap the loss *and* its backward."""
    return _torch_loss_parallel() if enabled else contextlib.nullcontext()
