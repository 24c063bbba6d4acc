"""Float8 training: the model's ``nn.Linear`` layers become torchao's ``Float8Linear``, whose matmuls take
their inputs, weights and output gradients in float8 with dynamic scales (torchao's recipes):

- ``tensorwise``: one scale per tensor; fastest. Under FSDP2 the weights are all-gathered in float8
  (torchao's ``enable_fsdp_float8_all_gather``): half the bytes of bf16 for the converted layers.
- ``rowwise``: one scale per row (finer, more accurate; all-gathered in the parameter dtype).

Which layers: every ``nn.Linear`` whose two dimensions are multiples of 16 (the float8 matmul's
requirement), except the model's output head (its logits feed the loss, where float8's rounding costs
accuracy for little time) and a layer tied to an embedding. torchao's own filters also skip layers it
judges too small to gain on an H100; this one does not, so that what is converted does not depend on a
benchmark of one GPU, and so that small models on CPU (the tests) convert too.

The conversion runs on the meta model, before tensor parallelism and FSDP (torchtitan's order): torchao's
module keeps the same parameters (state-dict keys unchanged, so checkpoints move between float8 and not),
and ``to_empty`` in the materialise step keeps its weight wrapper for the float8 all-gather.

Float8 matmuls need an NVIDIA GPU of compute capability 8.9 or more (Ada, Hopper, Blackwell); another GPU
is refused before launch (``device_refusal``). On CPU torchao emulates them (``emulate=True``: the values
are rounded to float8 as on a GPU, the matmul runs in higher precision), which is how the tests show
its losses next to bf16's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

#: what ``float8`` may be set to
RECIPES = ("tensorwise", "rowwise")
#: the float8 matmul's alignment: both dimensions of a converted layer are multiples of it
ALIGN = 16
#: compute capability from which an NVIDIA GPU has float8 tensor cores
MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Float8:
    """The float8 step of ``parallelize``: the recipe, whether to emulate (no float8 hardware: CPU), whether
    FSDP2 all-gathers the converted weights in float8 (tensorwise under FSDP), and the layers whose output
    the model modifies in place (``modified_in_place``), which get an output of their own."""

    recipe: str
    emulate: bool = False
    fsdp_all_gather: bool = False
    own_output: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"float8 must be false, {' or '.join(RECIPES)}, got {self.recipe!r}")
        if self.fsdp_all_gather and self.recipe != "tensorwise":
            raise ValueError("float8 all-gather under FSDP is torchao's for the tensorwise recipe only")


def float8_option(value: object) -> str | None:
    """The ``float8`` option as a recipe name, or None (off): false/null/"false" are off."""
    if value is None or value is False or value == "false":
        return None
    if value in RECIPES:
        return str(value)
    raise ValueError(f"float8 must be false, {' or '.join(RECIPES)}, got {value!r}")


def device_refusal(device: torch.device) -> str | None:
    """Why float8 cannot train on ``device`` (None: it can; CPU emulates)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"float8 needs an NVIDIA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or more "
                f"(Ada, Hopper, Blackwell); {name} is {major}.{minor}: set float8=false")
    return None


def output_layers(tp_plan: dict[str, str]) -> list[str]:
    """The plan's output layers (its tensor-parallel style "output"): float8 leaves them alone."""
    return [path for path, style in tp_plan.items() if style == "output"]


def missing_torchao() -> str | None:
    """Why float8 cannot run in this environment (None: torchao is installed)."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return 'float8 needs torchao: pip install "lightning-par[float8]"'
    return None


def excluded(model: nn.Module, heads: Iterable[str] = ()) -> set[str]:
    """Paths of the linear layers never converted: ``heads`` (the plan's output layers) and every module
    a submodule names as its output embeddings (Hugging Face's ``get_output_embeddings``), plus any
    linear layer whose weight is an embedding's (tied)."""
    paths = {p for p in heads}
    by_id = {id(m): p for p, m in model.named_modules()}
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for path, m in model.named_modules():
        getter = getattr(m, "get_output_embeddings", None)
        if callable(getter):
            try:
                head = getter()
            except (NotImplementedError, AttributeError):
                head = None
            if isinstance(head, nn.Module) and id(head) in by_id:
                paths.add(by_id[id(head)])
        if isinstance(m, nn.Linear) and id(m.weight) in embedding_weights:
            paths.add(path)
    return paths


def convertible(model: nn.Module, heads: Iterable[str] = ()) -> list[str]:
    """The paths of the layers ``apply_float8`` converts (module docstring: which layers)."""
    skip = excluded(model, heads)
    return [p for p, m in model.named_modules()
            if isinstance(m, nn.Linear) and p not in skip
            and m.in_features % ALIGN == 0 and m.out_features % ALIGN == 0]


def apply_float8(module: nn.Module, spec: Float8, heads: Iterable[str] = ()) -> list[str]:
    """Swap ``module``'s convertible linear layers for torchao's ``Float8Linear`` in place; returns their
    paths. ``heads``: the output layers, by path in ``module``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = set(convertible(module, heads))
    if not chosen:
        return []
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(spec.recipe), emulate=spec.emulate,
                                 enable_fsdp_float8_all_gather=spec.fsdp_all_gather)
    convert_to_float8_training(module, config=config, module_filter_fn=lambda _m, fqn: fqn in chosen)
    for path in chosen.intersection(spec.own_output):
        module.get_submodule(path).register_forward_hook(_own_output)
    return sorted(chosen)


def _own_output(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
    # torchao's matmul Function returns a view it made (a reshape of its product): autograd forbids changing
    # such a view in place, which a decoder may do to a projection's output (Falcon's ``mlp_output +=
    # attention_output``, Llama-4's residual add). One copy, only for the layers the probe found.
    return out.clone()


def modified_in_place(module: nn.Module, forward: Callable[[], object], paths: Iterable[str]) -> tuple[str, ...]:
    """The layers among ``paths`` whose output the model's ``forward()`` (a meta-device forward: shapes only)
    modifies in place, read from the outputs' version counters: under float8 each needs an output of its own
    (``Float8.own_output``)."""
    seen: dict[str, list[tuple[torch.Tensor, int]]] = {}

    def record(path: str) -> Callable:
        def hook(_m: nn.Module, _args: tuple, out: object) -> None:
            if isinstance(out, torch.Tensor):
                seen.setdefault(path, []).append((out, out._version))
        return hook

    handles = [module.get_submodule(p).register_forward_hook(record(p)) for p in paths]
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in handles:
            h.remove()
    return tuple(sorted(p for p, outs in seen.items() if any(o._version != v for o, v in outs)))


def float8_weights(module: nn.Module) -> list[torch.Tensor]:
    """The weights of ``module``'s layers that compute in float8 (whole sizes, also when sharded)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return []
    return [m.weight for m in module.modules() if isinstance(m, Float8Linear)]


def float8_tp_style(name: str, module: nn.Module, *, output_layouts: object = None) -> object | None:
    """torchao's float8 tensor-parallel style for plan style ``name`` on ``module``, where one applies: a
    ``colwise``/``rowwise`` layer converted with the tensorwise recipe (its input all-gathered, its output
    gradient reduced, in float8). None otherwise: rowwise-scaled layers and every other style take the
    plain styles, on which torchao's ``Float8Linear`` computes with the local shard's scales.
    ``output_layouts``: the rowwise style's output layout (sequence parallelism: the sequence shard)."""
    try:
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
    except ImportError:
        return None
    if not isinstance(module, Float8Linear) or name not in ("colwise", "rowwise"):
        return None
    if module.config.cast_config_input.scaling_granularity is not ScalingGranularity.TENSORWISE:
        return None
    if name == "colwise":
        return Float8ColwiseParallel()

    class OwnedFloat8RowwiseParallel(Float8RowwiseParallel):
        """Its local output a tensor of its own, as ``tensor_parallel.OwnedRowwiseParallel``'s (a decoder may
        add to it in place)."""

        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001, ANN205
            out = Float8RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
            return out.clone() if use_local_output and not isinstance(out, torch.distributed.tensor.DTensor) else out

    return OwnedFloat8RowwiseParallel() if output_layouts is None else OwnedFloat8RowwiseParallel(
        output_layouts=output_layouts)
