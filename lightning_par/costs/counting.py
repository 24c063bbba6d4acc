"""Parameter counting and layout of the model a ``Shape`` describes, read from the model itself built
on the meta device (no memory): our GPT / MoE (``models/gpt.py``, ``models/moe.py``) or a Hugging Face
decoder (``models/hf/causal_lm.py``'s transformers model with one layer: every layer has the same parameters).

- ``units``: parameters of the model's parts (embedding, one block, head, each linear, MoE experts, a
  tied head, what tensor parallelism splits, tensor counts) -- the one parameter count of the cost
  model (``Shape.units``);
- ``tp_params`` / ``root_params`` / ``param_tensors``: the groups the comm model prices (a
  tensor-parallel rank's parameters, FSDP's root, the parameter tensors);
- ``module_paths`` / ``block_linears`` / ``tiled_part``: the paths ``strategy.tiling`` names and the
  matmuls a tile count must divide; ``hf_model`` / ``hf.plan``: a Hugging Face shape's meta model
  and the parallel plan it declares.

Every function takes a ``costs.shape.Shape`` (which imports this module: the type is not imported here).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

#: a ``costs.shape.Shape`` (shape.py imports this module, so its class is named, not imported)
ShapeT = Any


def units(shape: ShapeT) -> dict[str, int]:
    """``Shape.units``: the parameters of the model's parts, counted from the model built on the meta device.
    With LoRA (``shape.lora``) the parts hold their adapters too (``block``, ``total``, ``block_tp_split``...);
    the linears' own counts (``block_matmul``, ``block.<path>``) stay the base model's."""
    if shape.lora is None:
        return dict(_hf_unit_params(shape) if shape.hf else _unit_params(shape))
    out = units(_base(shape))
    lo = lora_units(shape)
    for part in ("embed", "block", "head"):
        out[part] += lo[f"{part}_lora"]
        out[f"{part}_tp_split"] += lo[f"{part}_lora_tp_split"]
        out[f"{part}_tensors"] += lo[f"{part}_lora_tensors"]
    out["total"] += lo["embed_lora"] + shape.n_layer * lo["block_lora"] + lo["head_lora"]
    return out


def _base(shape: ShapeT) -> ShapeT:
    """``shape`` without LoRA: the model the adapters are put on."""
    import dataclasses

    return dataclasses.replace(shape, lora=None)


#: which input a block's linear reads, by the last component of its path (what ``activations.lora_layer_delta``
#: prices): the attention's input (the first norm's output), its output (the o-projection's input), the MLP's input
#: (the second norm's output) and its inner activation (the down-projection's input); GPT-2's ``c_proj`` is the
#: attention's or the MLP's by its parent
LINEAR_INPUTS = {"wq": "attn_in", "wk": "attn_in", "wv": "attn_in", "q_proj": "attn_in", "k_proj": "attn_in",
                 "v_proj": "attn_in", "c_attn": "attn_in", "wo": "attn_out", "o_proj": "attn_out",
                 "fc": "mlp_in", "gate_proj": "mlp_in", "up_proj": "mlp_in", "c_fc": "mlp_in",
                 "proj": "mlp_out", "down_proj": "mlp_out"}


def linear_input(path: str) -> str:
    """``LINEAR_INPUTS``' group of a block linear's path (``attn.wq``, ``self_attn.q_proj``, ``mlp.c_proj``)."""
    last = path.rsplit(".", 1)[-1]
    if last == "c_proj":
        return "attn_out" if "attn" in path else "mlp_out"
    if last not in LINEAR_INPUTS:
        raise ValueError(f"the cost model does not know which input the block linear {path!r} reads")
    return LINEAR_INPUTS[last]


def lora_units(shape: ShapeT) -> dict[str, Any]:
    """What LoRA (``shape.lora``: ``parallel/adapters/lora.py``) does to the model, counted from the model built on
    the meta device (one decoder layer; every layer alike) with the adapters applied as the LightningModule
    applies them (``ParModule.adapt``: our GPT's output head excluded; everything else frozen but the adapters and
    ``lora.train``'s modules)::

        <part>_lora / _lora_tp_split / _lora_tensors   the adapters' parameters in embed / block / head, the part of
                                                      them tensor parallelism splits (colwise: B, rowwise: A), their
                                                      tensors
        <part>_trainable, trainable                   parameters that train (adapters and lora.train's modules), in a
                                                      part and in the model (a tied table once: tied_trainable)
        largest_trainable                             the largest trainable tensor (ZeRO-2's bucket rule)
        trainable_tensors, block_trainable_split      trainable tensors; of a block's trainable, what tp splits
        block_adapted, block_adapted_numels           elements of the adapted linears' base weights in a block (what
                                                      ``lora.base=nf4`` stores in NF4), and each one's
        linears                                       (path in the block, in, out, state, input group) of every block
                                                      linear: state "adapted", "whole" (trains whole) or "frozen"
        embed_frozen, head_frozen                     no parameter of the embedding trains; the output layer's weight
                                                      is frozen (it then saves no input for backward)
        norms_frozen                                  no norm of a block trains (an RMSNorm then keeps no normalised
                                                      input for its weight's gradient)

    ValueError (one line) for what it does not price: an MoE model, targets that match no linear."""
    return dict(_lora_units(shape))


@lru_cache(maxsize=32)
def _lora_units(shape: ShapeT) -> tuple[tuple[str, Any], ...]:
    import fnmatch

    import torch
    from torch import nn

    from lightning_par.parallel.adapters.lora import LoRALinear, apply_lora

    cfg = shape.lora
    if shape.n_experts:
        raise ValueError("the cost model does not price LoRA on a mixture-of-experts model (its experts are "
                         "batched parameters, not linears); mode=estimate traces it")
    base = _base(shape)
    if shape.hf:
        from lightning_par.models.hf.causal_lm import LogitsOnly, _transformers
        from lightning_par.parallel.hf.plan import _matches, hf_blocks, hf_layers

        config = base.hf_config(layers=1)
        with torch.device("meta"):
            inner = _transformers().AutoModelForCausalLM.from_config(
                config, attn_implementation=config._attn_implementation)
        (block_path,) = hf_blocks(inner)
        layers = hf_layers(inner)
        at = layers.index(block_path)
        net: nn.Module = LogitsOnly(inner)  # what HFCausalLM adapts (models/hf/causal_lm.py: build_net)
        parts = {"embed": [f"net.{p}" for p in layers[:at]], "block": [f"net.{block_path}"],
                 "head": [f"net.{p}" for p in layers[at + 1:]]}
        plan = {f"net.{k}": v for k, v in hf_plan(base).tp_plan.items()}
        style_of = lambda path: next((v for k, v in plan.items() if _matches(k, path)), "")  # noqa: E731
        head_layer = inner.get_output_embeddings()
    else:
        from lightning_par.models.gpt import GPT, GPTConfig

        config = base.gpt_config(dense=True)
        with torch.device("meta"):
            net = GPT(GPTConfig(**{**config.__dict__, "n_layer": 1}))
        parts = {"embed": ["embed"], "block": ["blocks.0"], "head": ["head"]}
        plan = net.parallel_plan().tp_plan
        style_of = lambda path: next((v for k, v in plan.items()  # noqa: E731
                                      if fnmatch.fnmatchcase(path, k.replace("*", "[0-9]*"))), "")
        head_layer = net.get_output_embeddings()
    getter = getattr(net, "get_output_embeddings", None)  # as ParModule.adapt: the output layer, where it names one
    exclude = [getter()] if callable(getter) else []
    apply_lora(net, cfg, exclude=exclude)  # ValueError when the targets match no linear

    out: dict[str, Any] = {}
    seen: dict[str, dict[int, nn.Parameter]] = {}
    for part, paths in parts.items():
        params = {id(p): p for path in paths for p in net.get_submodule(path).parameters()}
        seen[part] = params
        lora = {id(m.lora_A.weight): m for path in paths for _, m in net.get_submodule(path).named_modules()
                if isinstance(m, LoRALinear)}
        adapters = [(m, m.lora_A.weight, m.lora_B.weight) for m in lora.values()]
        out[f"{part}_lora"] = sum(a.numel() + b.numel() for _, a, b in adapters)
        out[f"{part}_lora_tensors"] = 2 * len(adapters)
        split = 0
        for path in paths:
            for name, m in net.get_submodule(path).named_modules():
                if isinstance(m, LoRALinear):
                    style = style_of(f"{path}.{name}" if name else path).split(":")[0]
                    split += (m.lora_B.weight.numel() if style in ("colwise", "packed_colwise") else
                              m.lora_A.weight.numel() if style == "rowwise" else 0)
        out[f"{part}_lora_tp_split"] = split
        out[f"{part}_trainable"] = sum(p.numel() for p in params.values() if p.requires_grad)
    shared = set(seen["embed"]) & set(seen["head"])
    tied_trainable = sum(seen["embed"][k].numel() for k in shared if seen["embed"][k].requires_grad)
    out["trainable"] = (out["embed_trainable"] + shape.n_layer * out["block_trainable"] + out["head_trainable"]
                        - tied_trainable)
    out["tied_trainable"] = tied_trainable
    out["largest_trainable"] = max((p.numel() for ps in seen.values() for p in ps.values() if p.requires_grad),
                                   default=0)
    count = lambda part: sum(1 for p in seen[part].values() if p.requires_grad)  # noqa: E731
    out["trainable_tensors"] = count("embed") + shape.n_layer * count("block") + count("head") - sum(
        1 for k in shared if seen["embed"][k].requires_grad)
    block = net.get_submodule(parts["block"][0])
    linears, adapted = [], []
    for name, m in _matmuls(block).items():
        if ".lora_A" in f".{name}" or ".lora_B" in f".{name}":
            continue
        state = "adapted" if isinstance(m, LoRALinear) else "whole" if m.weight.requires_grad else "frozen"
        n_in, n_out = (m.in_features, m.out_features) if hasattr(m, "in_features") else m.weight.shape
        linears.append((name, int(n_in), int(n_out), state, linear_input(name)))
        if state == "adapted":
            adapted.append(m.weight.numel())
    trained_whole = sum(m.weight.numel() for n, m in _matmuls(block).items() if n in
                        {x[0] for x in linears if x[3] == "whole"})
    out["block_trainable_split"] = out["block_lora_tp_split"] + (trained_whole if trained_whole else 0)
    out["block_adapted"] = sum(adapted)
    out["block_adapted_numels"] = tuple(adapted)
    out["linears"] = tuple(linears)
    out["embed_frozen"] = out["embed_trainable"] == 0
    out["norms_frozen"] = not any(p.requires_grad for m in block.modules() if "norm" in type(m).__name__.lower()
                                  for p in m.parameters(recurse=False))
    out["head_frozen"] = not head_layer.weight.requires_grad
    out["rank"] = cfg.rank
    return tuple(out.items())


# parameter groups the comm model prices, split as the model's declared tensor-parallel plan splits
# them; a tied head shares its table with the embedding (both split alike, by vocabulary rows): counted once
def tp_params(shape: ShapeT, tp: int) -> int:
    """Parameters one tensor-parallel rank holds: split matrices / tp, replicated rest in full."""
    u = units(shape)
    tied = u.get("tied", 0)
    split = shape.n_layer * u["block_tp_split"] + u["embed_tp_split"] + u["head_tp_split"] - tied
    dense = u["embed"] + shape.n_layer * u["block"] + u["head"] - tied
    return split // tp + dense - split


def tp_trainable(shape: ShapeT, tp: int = 1) -> int:
    """Parameters one tensor-parallel rank trains: without LoRA ``tp_params``; with it the adapters as
    ``parallel/adapters/lora.lora_placements`` splits them (colwise: B, rowwise: A; the other replicated) and
    ``lora.train``'s modules (a trained embedding or head split like its base, a block's whole linear likewise)."""
    if shape.lora is None:
        return tp_params(shape, tp)
    lo = lora_units(shape)
    block = lo["block_trainable_split"] // tp + lo["block_trainable"] - lo["block_trainable_split"]
    return (lo["embed_trainable"] + lo["head_trainable"] - lo["tied_trainable"]) // tp + shape.n_layer * block


def root_params(shape: ShapeT, tp: int = 1) -> int:
    """Parameters FSDP leaves to the root (no unit claims them): embeddings, final norm, head."""
    u = units(shape)
    tied = u.get("tied", 0)
    split = u["embed_tp_split"] + u["head_tp_split"] - tied
    return split // tp + u["embed"] + u["head"] - tied - split


def param_tensors(shape: ShapeT) -> int:
    """Parameter tensors of the dense model. MoE blocks are counted as dense ones: the count only
    prices zero2's per-step 4-byte flags, a rounding error beside Ψ."""
    u = units(shape)
    return u["embed_tensors"] + shape.n_layer * u["block_tensors"] + u["head_tensors"] - (1 if u.get("tied") else 0)


#: the modules ``strategy.tiling`` names, in our GPT (``GPTModule.net``; Hugging Face: ``module_paths``)
GPT_PATHS = {"blocks": "net.blocks", "head": "net.head.lm_head", "embed": "net.embed.tok"}


def module_paths(shape: ShapeT) -> dict[str, str]:
    """Paths in the LightningModule (as ``strategy.tiling`` names modules) of the decoder layers'
    list (``blocks``: layer ``i`` is ``<blocks>.i``), the output head and the token embedding."""
    return dict(_hf_layout(shape)[0]) if shape.hf else dict(GPT_PATHS)


def block_linears(shape: ShapeT) -> dict[str, int]:
    """A block's matmul layers (path inside the block) and their output features -- what a tile count
    must divide (``parallel/memory/tiling.py``: nn.Linear rows, transformers' Conv1D columns)."""
    return dict(_hf_layout(shape)[1]) if shape.hf else dict(_gpt_linears(shape))


def tiled_part(shape: ShapeT, path: str) -> str | None:
    """What a ``strategy.tiling`` path names: ``"head"``, ``"embed"``, a block's matmul as its
    ``units`` key (``block.<path in the block>``), or None."""
    p = {k: v.removeprefix("net.") for k, v in module_paths(shape).items()}
    dotted, blocks = f".{path}", f".{p['blocks']}."
    if dotted.endswith(f".{p['head']}"):
        return "head"
    if dotted.endswith(f".{p['embed']}"):
        return "embed"
    if blocks in dotted:
        return "block." + dotted.split(blocks, 1)[1].split(".", 1)[1]
    return None


def _matmuls(module: Any) -> dict[str, Any]:
    """The ``nn.Linear`` and transformers ``Conv1D`` (GPT-2's: ``x @ W + b`` with ``W`` (in, out),
    recognised by name as ``parallel/memory/tiling.py`` does) layers of ``module`` by path."""
    from torch import nn

    return {name: m for name, m in module.named_modules()
            if isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D" and hasattr(m, "nf"))}


@lru_cache(maxsize=64)
def _gpt_linears(shape: ShapeT) -> tuple[tuple[str, int], ...]:
    import torch

    from lightning_par.models.gpt import Block

    with torch.device("meta"):
        block = Block(shape.gpt_config(dense=True))
    return tuple((name, m.out_features) for name, m in _matmuls(block).items())


@lru_cache(maxsize=16)
def hf_model(shape: ShapeT) -> Any:
    """The Hugging Face model of ``shape`` with one decoder layer, on the meta device: every layer has
    the same parameters, so one is all the counts need."""
    import torch

    from lightning_par.models.hf.causal_lm import _transformers

    config = shape.hf_config(layers=1)
    with torch.device("meta"):
        return _transformers().AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)


@lru_cache(maxsize=16)
def hf_plan(shape: ShapeT) -> Any:
    """The ``ParallelPlan`` the Hugging Face model of ``shape`` declares (``parallel/hf/plan.py``:
    its tensor-parallel plan and the sizes tp must divide, its pipeline cut points, refusals) -- what
    the strategies will use, so what the advisor may propose. Its paths are the one-layer model's."""
    from lightning_par.parallel.hf.plan import hf_parallel_plan

    return hf_parallel_plan(hf_model(shape))


@lru_cache(maxsize=16)
def _hf_layout(shape: ShapeT) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, int], ...]]:
    from lightning_par.parallel.hf.plan import hf_blocks

    net = hf_model(shape)
    (block,) = hf_blocks(net)  # "model.layers.0"
    where = {id(m): name for name, m in net.named_modules()}
    paths = {"blocks": "net." + block.rsplit(".", 1)[0], "head": "net." + where[id(net.get_output_embeddings())],
             "embed": "net." + where[id(net.get_input_embeddings())]}
    linears = {name: (m.out_features if hasattr(m, "out_features") else m.nf)
               for name, m in _matmuls(net.get_submodule(block)).items()}
    return tuple(paths.items()), tuple(linears.items())


@lru_cache(maxsize=16)
def _hf_unit_params(shape: ShapeT) -> tuple[tuple[str, int], ...]:
    """``units`` of a Hugging Face shape, from the transformers model with one layer: ``embed`` is
    what its pipeline plan places before the decoder layers (token table, GPT-2's position table),
    ``head`` what it places after them (final norm, output head), each counted whole."""
    from lightning_par.parallel.hf.plan import _matches, hf_blocks, hf_layers  # _matches: the plans' "*" rule

    net = hf_model(shape)
    (block_path,) = hf_blocks(net)
    block = net.get_submodule(block_path)
    layers = hf_layers(net)  # in forward order: embeddings, the layer, final norm, head
    at = layers.index(block_path)

    def params(paths: tuple[str, ...]) -> dict[int, Any]:
        return {id(p): p for path in paths for p in net.get_submodule(path).parameters()}

    embed, head = params(layers[:at]), params(layers[at + 1:])
    count = lambda ps: sum(p.numel() for p in ps.values())  # noqa: E731
    tied = sum(p.numel() for k, p in head.items() if k in embed)
    units = {f"block.{name}": m.weight.numel() for name, m in _matmuls(block).items()}
    matmuls = [units[k] for k in units]
    units |= {"embed": count(embed), "block": sum(p.numel() for p in block.parameters()), "head": count(head),
              "lm_head": net.get_output_embeddings().weight.numel(),
              "embed_table": net.get_input_embeddings().weight.numel(),
              "block_matmul": sum(matmuls), "block_linear": max(matmuls), "tied": tied}
    units["total"] = units["embed"] + shape.n_layer * units["block"] + units["head"] - tied
    every = {id(p) for p in net.parameters()}
    assert every == set(embed) | set(head) | {id(p) for p in block.parameters()}, "a parameter outside the plan's parts"
    # what tensor parallelism splits, by the model's own plan as hf_plan translates it (colwise, packed,
    # vocabulary splits: every parameter of the module; rowwise: the weight, its bias replicated)
    plan = hf_plan(shape).tp_plan
    for part, paths in (("embed", layers[:at]), ("block", (block_path,)), ("head", layers[at + 1:])):
        split, tensors = 0, set()
        for path in paths:
            for name, m in net.get_submodule(path).named_modules():
                full = f"{path}.{name}" if name else path
                style = next((v for k, v in plan.items() if _matches(k, full)), "")
                own = list(m.parameters(recurse=False))
                if style.split(":")[0] in ("colwise", "packed_colwise", "embedding", "output"):
                    split += sum(p.numel() for p in own)
                elif style == "rowwise":
                    split += m.weight.numel()
            tensors |= {id(p) for p in net.get_submodule(path).parameters()}
        units[f"{part}_tp_split"] = split
        units[f"{part}_tensors"] = len(tensors)
    return tuple(units.items())


@lru_cache(maxsize=64)
def _unit_params(shape: ShapeT) -> tuple[tuple[str, int], ...]:
    import fnmatch

    import torch
    from torch import nn

    from lightning_par.models.gpt import GPT, GPTConfig

    config = shape.gpt_config(dense=True)
    one = GPTConfig(**{**config.__dict__, "n_layer": 1})  # one block is every block
    with torch.device("meta"):
        net = GPT(one)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    block = net.blocks[0]
    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    units = {f"block.{name}": m.weight.numel() for name, m in block.named_modules() if isinstance(m, nn.Linear)}
    units |= {"embed": count(net.embed), "block": count(block), "head": count(net.head),
             "lm_head": net.head.lm_head.weight.numel(), "embed_table": net.embed.tok.weight.numel(),
             "block_matmul": sum(m.weight.numel() for m in linears),
             "block_linear": max(m.weight.numel() for m in linears)}
    units["total"] = units["embed"] + config.n_layer * units["block"] + units["head"]
    # what tensor parallelism splits, by the model's own plan (colwise / vocabulary splits: weight and
    # bias; rowwise: the weight, its bias replicated), and tensor counts (ZeRO-2's per-tensor flags)
    plan = net.parallel_plan().tp_plan
    for part, module in (("embed", net.embed), ("block", block), ("head", net.head)):
        prefix = "blocks.0" if part == "block" else part
        split = 0
        for name, m in module.named_modules():
            full = f"{prefix}.{name}" if name else prefix
            style = next((v for k, v in plan.items() if fnmatch.fnmatchcase(full, k.replace("*", "[0-9]*"))), None)
            if style in ("colwise", "embedding", "output"):
                split += sum(p.numel() for p in m.parameters(recurse=False))
            elif style == "rowwise":
                split += m.weight.numel()
        units[f"{part}_tp_split"] = split
        units[f"{part}_tensors"] = len(list(module.parameters()))
    if shape.n_experts:
        from lightning_par.models.moe import MoE, MoEBlock

        moe_config = shape.gpt_config()
        with torch.device("meta"):
            moe_block = MoEBlock(moe_config, moe=True)
        layer = next(m for m in moe_block.modules() if isinstance(m, MoE))
        units["moe_block"] = count(moe_block)
        units["moe_experts"] = count(layer.experts)
        units["moe_matmul"] = units["block_matmul"] - units["block.mlp.fc"] - units["block.mlp.proj"] + sum(
            m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
        units["total"] += shape.n_moe_layers * (units["moe_block"] - units["block"])
    return tuple(units.items())
