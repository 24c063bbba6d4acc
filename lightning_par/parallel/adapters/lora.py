"""LoRA: low-rank adapters on a frozen model (Hu et al. 2021), as a class swap of the target linears.

A target ``nn.Linear`` becomes a ``LoRALinear`` in place (its class is swapped, as ``chunked_loss.make_chunked``
does): it keeps its own ``weight`` and ``bias`` under the same state-dict keys, frozen, and gains two small
linears, ``lora_A`` (in -> r) and ``lora_B`` (r -> out), the only parameters that train:

    y = x W^T + b + (alpha / r) * B(A(dropout(x)))

Why not PEFT's ``get_peft_model``? It wraps the model (``base_model.model...``: every parameter path changes) and
each target in a ``ModuleDict`` per adapter, so the plan's paths, the pretrained loader's keys, the meta-device
init groups and the tensor-parallel styles would all have to learn a second naming. The class swap keeps every
base key, the adapters' keys are PEFT's own (``<target>.lora_A.weight``, ``<target>.lora_B.weight``, its saved
adapter format minus the ``base_model.model.`` prefix), and the export writes PEFT's adapter format
(``strategies/checkpoint/lora_export.py``); PEFT loads it and is the tests' reference.

The adapters start as PEFT's do: ``A`` kaiming-uniform (a = sqrt(5), ``nn.Linear``'s rule), ``B`` zeros, so the
model before the first step is the base model. On the meta device their values come from ``reset_lora`` through
the init function (``with_lora_init``), seeded per init group like every other tensor, so every layout starts
from the same adapters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
from torch import nn

#: the default targets: attention and MLP projections of the families we know (the last path component),
#: as PEFT's and torchtune's LoRA recipes choose them
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",  # llama-like
                   "qkv", "proj", "fc", "c_attn", "c_proj", "c_fc",  # lightning_par's GPT, gpt2
                   "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "fc1", "fc2", "out_proj",
                   "wq", "wk", "wv", "wo", "w1", "w2", "w3", "Wqkv", "gate_up_proj")
BASES = ("none", "nf4")


@dataclass(frozen=True)
class LoRAConfig:
    """``model.lora``: rank 0 is full fine-tuning (no adapters)."""

    rank: int = 0
    alpha: float = 16.0
    #: the last path component of the linears to adapt, or fnmatch patterns over whole paths (with a ".")
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0
    #: the frozen base's storage: "none" (the training dtype) or "nf4" (QLoRA, torchao's NF4Tensor)
    base: str = "none"
    #: modules that train whole beside the adapters (PEFT's ``modules_to_save``), by last path component
    train: tuple[str, ...] = field(default_factory=tuple)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def matches(self, path: str) -> bool:
        last = path.rsplit(".", 1)[-1]
        return any(fnmatchcase(path, t) if "." in t or "*" in t else last == t for t in self.targets)


def lora_option(value: object) -> LoRAConfig | None:
    """``model.lora`` (a mapping or None) as a config, or None when off; ``ValueError`` in one line."""
    if value is None or value is False:
        return None
    if isinstance(value, LoRAConfig):
        return value if value.rank > 0 else None
    if not hasattr(value, "items"):
        raise ValueError(f"lora must be a mapping (rank, alpha, targets, dropout, base), got {value!r}")
    known = {"rank", "alpha", "targets", "dropout", "base", "train"}
    items = dict(value.items())
    unknown = sorted(set(items) - known)
    if unknown:
        raise ValueError(f"lora: unknown keys {unknown}; known: {', '.join(sorted(known))}")
    rank = items.get("rank") or 0
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"lora.rank must be a non-negative integer, got {rank!r}")
    if rank == 0:
        return None
    targets = items.get("targets")
    targets = DEFAULT_TARGETS if targets in (None, "default") else (
        (targets,) if isinstance(targets, str) else tuple(str(t) for t in targets))
    base = items.get("base") or "none"
    if base not in BASES:
        raise ValueError(f"lora.base must be one of {', '.join(BASES)}, got {base!r}")
    dropout = float(items.get("dropout") or 0.0)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora.dropout must be in [0, 1), got {dropout}")
    train = items.get("train") or ()
    return LoRAConfig(rank=rank, alpha=float(items.get("alpha", 2 * rank) or 2 * rank), targets=targets,
                      dropout=dropout, base=base, train=(train,) if isinstance(train, str) else tuple(train))


class LoRAFactor(nn.Linear):
    """``lora_A`` or ``lora_B``: a plain linear whose values its owner (``LoRALinear.reset_lora``) sets."""

    role: str = "A"


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` with a trainable low-rank update (made by ``make_lora``, never constructed)."""

    lora_A: LoRAFactor
    lora_B: LoRAFactor
    scaling: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _is_nf4(self.weight):  # QLoRA: torchao's matmul dequantizes the 4-bit weight (its backward: input grad only)
            out = _linear_nf4(x, self.weight)
            out = out + self.bias.to(out.dtype) if self.bias is not None else out
        else:
            out = F.linear(x, self.weight, self.bias)
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return out + self.lora_B(self.lora_A(h)) * self.scaling

    @torch.no_grad()
    def reset_lora(self) -> None:
        """PEFT's start: A kaiming-uniform (``nn.Linear``'s rule), B zeros (the update is zero at step 0)."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def reset_parameters(self) -> None:  # nn.Linear's constructor calls it before the adapters exist
        super().reset_parameters()
        if "lora_A" in self._modules:
            self.reset_lora()

    def merged_weight(self) -> torch.Tensor:
        """``W + (alpha / r) B A`` (the merged export's weight), in the base weight's dtype."""
        delta = self.lora_B.weight.float() @ self.lora_A.weight.float()
        return (self.weight.float() + self.scaling * delta).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.lora_A.out_features}, scaling={self.scaling:g}"


def make_lora(layer: nn.Linear, cfg: LoRAConfig) -> LoRALinear:
    """Swap ``layer``'s class to ``LoRALinear`` in place and add its adapters (on the weight's device: meta
    under lightning_par's strategies), base frozen."""
    if isinstance(layer, LoRALinear):
        return layer
    if type(layer) is not nn.Linear:
        raise ValueError(f"lora: {type(layer).__name__} is not a plain nn.Linear")
    device, dtype = layer.weight.device, layer.weight.dtype
    a = LoRAFactor(layer.in_features, cfg.rank, bias=False, device=device, dtype=dtype)
    b = LoRAFactor(cfg.rank, layer.out_features, bias=False, device=device, dtype=dtype)
    b.role = "B"
    layer.__class__ = LoRALinear
    layer.lora_A, layer.lora_B = a, b
    layer.scaling, layer.lora_dropout = cfg.scaling, cfg.dropout
    if device.type != "meta":
        layer.reset_lora()
    return layer


def apply_lora(net: nn.Module, cfg: LoRAConfig, *, exclude: Iterable[nn.Module] = ()) -> list[str]:
    """Adapt every plain ``nn.Linear`` of ``net`` that ``cfg`` targets (``exclude``: the output head and other
    layers never adapted) and freeze everything else (but ``cfg.train``'s modules). Returns the adapted paths;
    ``ValueError`` if none matched."""
    skip = {id(m) for m in exclude}
    paths = [p for p, m in net.named_modules()
             if type(m) is nn.Linear and id(m) not in skip and cfg.matches(p)]
    if not paths:
        names = sorted({p.rsplit(".", 1)[-1] for p, m in net.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"lora.targets {list(cfg.targets)} match no linear layer; this model's are: {', '.join(names)}")
    for p in net.parameters():
        p.requires_grad_(False)
    for p in paths:
        make_lora(net.get_submodule(p), cfg)
    trained = {p for p, _ in net.named_modules() if p and p.rsplit(".", 1)[-1] in cfg.train}
    for name, p in net.named_parameters():
        if ".lora_A." in f".{name}" or ".lora_B." in f".{name}" or any(name.startswith(t + ".") for t in trained):
            p.requires_grad_(True)
    return paths


# a LoRA layer's keys in a state dict (the export's and the sharded save's; ``strategies/checkpoint/lora_export.py``)
_A, _B = ".lora_A.weight", ".lora_B.weight"


def is_adapter_key(name: str) -> bool:
    return name.endswith(_A) or name.endswith(_B)


def adapter_keys(weight: str) -> tuple[str, str]:
    """``<layer>.weight`` -> (``<layer>.lora_A.weight``, ``<layer>.lora_B.weight``)."""
    layer = weight.removesuffix(".weight")
    return layer + _A, layer + _B


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling * B @ A`` in fp32, returned in ``W``'s dtype (``LoRALinear.merged_weight``'s arithmetic). A
    QLoRA base (torchao's ``NF4Tensor``) is dequantized first: the merged model is a plain one."""
    if callable(original := getattr(weight, "get_original_weight", None)):
        weight = original()
    delta = b.float() @ a.float()
    return (weight.float() + scaling * delta).to(weight.dtype)


def lora_layers(module: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(p, m) for p, m in module.named_modules() if isinstance(m, LoRALinear)]


def with_lora_init(init: Callable[[nn.Module], None] | None) -> Callable[[nn.Module], None]:
    """The model's init function, with the adapters set by their owner: a ``LoRAFactor`` is skipped (the model's
    rule would draw it as a weight), a ``LoRALinear`` gets the model's rule for its base, then ``reset_lora``."""

    def init_fn(sub: nn.Module) -> None:
        if isinstance(sub, LoRAFactor):
            return
        if init is not None:
            init(sub)
        elif callable(reset := getattr(sub, "reset_parameters", None)) and not isinstance(sub, LoRALinear):
            reset()
        if isinstance(sub, LoRALinear):
            if init is None:
                nn.Linear.reset_parameters(sub)
            sub.reset_lora()

    return init_fn


def lora_placements(sub: nn.Module, name: str, kind: str) -> Sequence[object] | None:
    """The tensor-parallel placements of a LoRA layer's parameter ``name`` (own, not recursive) when the layer's
    style is ``kind`` (colwise / rowwise), or None for a module that is not part of a LoRA layer.

    colwise (``W`` split by output rows): ``A`` replicated (it reads the whole input), ``B`` split like ``W``
    (its rows are output features). rowwise (``W`` split by input columns): ``A`` split like ``W`` (its columns
    are input features; ``A x`` is then a partial sum), ``B`` replicated; the partial sums of the base and the
    update are reduced together by the layer's output all-reduce."""
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(sub, LoRAFactor):
        split = (sub.role == "B") if kind == "colwise" else (sub.role == "A")
        return [Shard(0 if kind == "colwise" else 1)] if split else [Replicate()]
    if isinstance(sub, LoRALinear):
        if kind == "colwise":
            return [Shard(0)]
        return [Shard(1)] if name == "weight" else [Replicate()]
    return None


# ----------------------------------------------------------------------------- QLoRA: the frozen base in NF4
def _nf4_module() -> Any:
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    return nf4_tensor


def _is_nf4(t: torch.Tensor) -> bool:
    return type(t).__name__ == "NF4Tensor"


def _linear_nf4(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _nf4_module().linear_nf4(x, weight)


def check_nf4_available() -> None:
    """``ValueError`` in one line when torchao (NF4) is missing."""
    try:
        _nf4_module()
    except ImportError:
        raise ValueError("lora.base=nf4 stores the base in torchao's NF4: pip install 'lightning_par[lora]'") from None


NF4_BLOCK = 64  #: values per absmax scale (QLoRA's and torchao's block)
NF4_SCALER_BLOCK = 256  #: scales per second-level scale (torchao's default), smaller where a weight has fewer


NF4_MIN_SCALER_GROUPS = 8  #: second-level groups a weight keeps at least, so FSDP can split it over up to 8 ranks


def nf4_blocks(numel: int) -> tuple[int, int]:
    """(block_size, scaler_block_size) for a weight of ``numel`` values: torchao's 64 and 256, the second cut for a
    small weight so that it keeps at least 8 second-level groups (FSDP2 splits an NF4 weight by its groups; the
    rule depends on the weight alone, so every layout quantizes alike). ``ValueError`` when 64 does not divide the
    weight."""
    if numel % NF4_BLOCK:
        raise ValueError(f"lora.base=nf4: a weight of {numel} values is not a multiple of NF4's {NF4_BLOCK}-value block")
    blocks = numel // NF4_BLOCK
    return NF4_BLOCK, max(1, math.gcd(NF4_SCALER_BLOCK, blocks // NF4_MIN_SCALER_GROUPS or 1))


@torch.no_grad()
def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` quantized to torchao's NF4Tensor (4 bits a value, a scale per 64 values, the scales quantized)."""
    block, scaler = nf4_blocks(weight.numel())
    return _nf4_module().to_nf4(weight.detach().contiguous(), block, scaler)


@torch.no_grad()
def quantize_bases(module: nn.Module) -> int:
    """Store the frozen weight of every LoRA layer of ``module`` as torchao's NF4 (QLoRA). On the meta device (the
    **quantize base** step, before FSDP) only the layout is made, and materialisation fills it (``fill_nf4``); a
    weight with values is quantized at once. Returns how many were converted (one already NF4 is left)."""
    n = 0
    for _, layer in lora_layers(module):
        w = layer.weight
        if _is_nf4(w):
            continue
        layer.weight = nn.Parameter(to_nf4(w), requires_grad=False)  # on meta: the NF4 layout only, no values
        n += 1
    return n


def check_nf4_split(module: nn.Module, shards: int) -> None:
    """``ValueError`` (one line) when FSDP cannot split a LoRA layer's NF4 weight over ``shards`` ranks: it splits
    the rows and the quantized blocks alike, so both must divide."""
    for path, layer in lora_layers(module):
        rows = layer.weight.shape[0]
        block, scaler = nf4_blocks(layer.weight.numel())
        groups = layer.weight.numel() // (block * scaler)
        if rows % shards or groups % shards:
            raise ValueError(f"lora.base=nf4: {path}.weight ({rows} rows, {groups} NF4 scale groups) does not split "
                             f"over {shards} FSDP ranks; use a data-parallel degree that divides both")


def is_nf4(t: torch.Tensor) -> bool:
    """An NF4 weight, or a DTensor whose local shard is one."""
    return _is_nf4(getattr(t, "_local_tensor", t))


@torch.no_grad()
def fill_nf4(target: torch.Tensor, full: torch.Tensor) -> None:
    """Quantize one whole weight ``full`` (full precision, host) and store ``target``'s piece of it: a plain NF4
    weight takes it all; a DTensor (FSDP2's shard of an NF4 weight, ``Shard(0)`` on one mesh dim) its chunk of
    rows. The whole weight is quantized before it is cut, so the values are the single-device run's."""
    from torch.distributed.tensor import DTensor, Shard

    q = to_nf4(full)
    local = target
    if isinstance(target, DTensor):
        local = target._local_tensor
        mesh, coord = target.device_mesh, target.device_mesh.get_coordinate()
        for dim, p in enumerate(target.placements):
            if isinstance(p, Shard):
                if p.dim != 0:
                    raise ValueError(f"lora.base=nf4: an NF4 weight split on dim {p.dim} (only rows are)")
                q = torch.chunk(q, mesh.size(dim), dim=0)[coord[dim]]
    local.copy_(q)  # the quantized values, the block scales and their factors
    # to_empty left the per-weight constants (the scales' mean, NF4's 16 code values) on meta: copy_ skips them
    local.scaler_mean, local.nf4 = q.scaler_mean.clone(), q.nf4.clone()


def dequantized_state(state: dict[str, Any]) -> dict[str, Any]:
    """A model state dict with each NF4 weight (plain, or a DTensor's NF4 shard) replaced by its values in full
    precision, laid out alike: a checkpoint of a QLoRA run holds plain tensors, which the exporter merges and
    transformers reads (torchao's subclass would be pickled into it)."""
    from torch.distributed.tensor import DTensor

    out = dict(state)
    for key, value in state.items():
        if not is_nf4(value):
            continue
        if isinstance(value, DTensor):
            out[key] = DTensor.from_local(value._local_tensor.get_original_weight(), value.device_mesh, value.placements,
                                          run_check=False, shape=value.shape, stride=value.stride())
        else:
            out[key] = value.get_original_weight()
    return out
