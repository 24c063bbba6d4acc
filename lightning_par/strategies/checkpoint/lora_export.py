"""A LoRA-trained model out of lightning_par: merged into a plain model (the default), or as a PEFT adapter.

A LoRA run (``model.lora.rank=R``, ``parallel/adapters/lora.py``) keeps every base key (``<layer>.weight``,
``<layer>.bias``, frozen) and adds ``<layer>.lora_A.weight`` ([r, in]) and ``<layer>.lora_B.weight`` ([out, r]);
the layer computes ``x W^T + b + scaling * B A x`` with ``scaling = alpha / r``. Two ways out:

- **merged** (``lightning-par-export``, ``save_pretrained``, ``callbacks.export.at_end``): each adapted
  ``<layer>.weight`` is written as ``W + scaling * B @ A`` (``merge``, the same arithmetic as
  ``LoRALinear.merged_weight``) and the adapter keys are left out, so the directory is the plain model
  transformers loads with ``AutoModelForCausalLM.from_pretrained`` (no missing or unexpected keys);
- **adapter** (``lightning-par-export --adapter``): PEFT's adapter directory, ``adapter_model.safetensors``
  (``base_model.model.<path in the Hugging Face model>.lora_A.weight`` / ``.lora_B.weight``, and the whole
  tensors of ``lora.train``'s modules, PEFT's ``modules_to_save``) and ``adapter_config.json``, which
  ``PeftModel.from_pretrained(base, DIR)`` loads onto the original base.

Why not PEFT's own ``merge_and_unload`` / ``save_pretrained``: there is no ``PeftModel`` here. The exporter
reads a sharded checkpoint tensor by tensor (no model is built, nothing is held whole), and the collective
``save_pretrained`` gathers one tensor at a time from a model sharded by FSDP or tensor parallelism; PEFT's
methods need the whole ``PeftModel`` in one process. The merge is one line of arithmetic on three tensors (a
layer's ``W``, ``A``, ``B``: what is in memory at a time) and the adapter format is a renaming plus a JSON
file, both checked against PEFT itself in ``tests/test_lora_export.py``.

Everything here works on state-dict keys and tensors; the callers (``export.py``, ``parallel/hf/save.py``)
read and write.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

# the key helpers and the merge live beside the layer (the sharded save in parallel/ uses them too); named here as
# the exporter's vocabulary
from lightning_par.parallel.adapters.lora import (_A, _B, LoRAConfig, adapter_keys, is_adapter_key,  # noqa: F401
                                                  lora_layers, lora_option, merge)

#: what PEFT's adapter directory holds, and the prefix of its keys before the model's own path
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRAFacts:
    """What an export needs to know of the run's LoRA: recorded in the checkpoint (``meta.pt``'s ``lora``)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    #: modules trained whole beside the adapters (``lora.train``; PEFT's ``modules_to_save``), by last path component
    train: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "train": list(self.train)}


def facts_of_module(module: nn.Module) -> dict[str, Any] | None:
    """The LoRA facts of a LightningModule (its ``lora`` config; else, for a module that called ``apply_lora``
    itself, its first adapted layer's), as plain values for the checkpoint; None without adapters. The config
    comes first: under a pipeline this rank's stages may hold no adapted layer."""
    cfg = getattr(module, "lora", None)
    if isinstance(cfg, LoRAConfig) and cfg.rank > 0:
        return LoRAFacts(cfg.rank, cfg.alpha, cfg.dropout, tuple(cfg.train)).as_dict()
    layers = lora_layers(module)
    if not layers:
        return None
    layer = layers[0][1]
    rank = layer.lora_A.out_features
    return LoRAFacts(rank, layer.scaling * rank, layer.lora_dropout).as_dict()


def facts_of_checkpoint(meta: Mapping[str, Any]) -> LoRAFacts | None:
    """A checkpoint's LoRA facts: ``meta.pt``'s ``lora`` (written by ``export_facts``), else the module's
    ``lora`` hyper-parameter; None when the run had none."""
    recorded = meta.get("lora")
    if recorded:
        return LoRAFacts(int(recorded["rank"]), float(recorded["alpha"]), float(recorded.get("dropout", 0.0)),
                         tuple(recorded.get("train", ())))
    cfg = lora_option((meta.get("hyper_parameters") or {}).get("lora"))
    return None if cfg is None else LoRAFacts(cfg.rank, cfg.alpha, cfg.dropout, tuple(cfg.train))


# ---------------------------------------------------------------------------------- keys
def adapted_weights(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Base weight key -> its (``lora_A``, ``lora_B``) keys, for every adapted layer among ``names``.
    ``ValueError`` when a layer has one factor or no base weight (not a LoRA checkpoint we wrote)."""
    present = set(names)
    out: dict[str, tuple[str, str]] = {}
    for name in sorted(present):
        if not name.endswith(_A):
            continue
        layer = name.removesuffix(_A)
        if layer + _B not in present or layer + ".weight" not in present:
            missing = layer + _B if layer + _B not in present else layer + ".weight"
            raise ValueError(f"LoRA layer {layer} has {name} but no {missing}")
        out[layer + ".weight"] = (name, layer + _B)
    orphans = sorted(n.removesuffix(_B) for n in present if n.endswith(_B) and n.removesuffix(_B) + ".weight" not in out)
    if orphans:
        raise ValueError(f"LoRA layer {orphans[0]} has {orphans[0] + _B} but no {orphans[0] + _A}")
    return out


def trains_whole(name: str, train: Iterable[str]) -> bool:
    """Whether parameter ``name`` belongs to a module that ``lora.train`` trains whole (any module on its path
    named so, as ``apply_lora`` chooses them)."""
    wanted = set(train)
    return any(part in wanted for part in name.split(".")[:-1])


def peft_names(names: Iterable[str], prefix: str, train: Iterable[str] = ()) -> dict[str, str]:
    """PEFT's key -> the checkpoint's key, for the adapters and the tensors of ``train``'s modules: the
    checkpoint's key less ``prefix`` (where the Hugging Face model sits in the LightningModule, e.g. ``net.``)
    under ``base_model.model.``. Keys outside ``prefix`` (not the Hugging Face model's) are not PEFT's."""
    out = {}
    for name in names:
        if not name.startswith(prefix):
            continue
        path = name.removeprefix(prefix)
        if is_adapter_key(path) or trains_whole(path, train):
            out[PEFT_PREFIX + path] = name
    return out


def target_modules(adapted: Iterable[str], modules: Iterable[str]) -> list[str] | str:
    """PEFT's ``target_modules`` for the adapted layer paths ``adapted`` of a model whose module paths are
    ``modules``: their last path components when those name exactly the adapted layers (PEFT matches a name
    against a path's end), else a regular expression of the paths themselves (PEFT matches a string whole)."""
    adapted = sorted(set(adapted))
    leaves = sorted({p.rsplit(".", 1)[-1] for p in adapted})
    matched = {p for p in modules if p.rsplit(".", 1)[-1] in leaves}
    if matched == set(adapted):
        return leaves
    return "^(?:" + "|".join(re.escape(p) for p in adapted) + ")$"


def adapter_config(facts: LoRAFacts, targets: list[str] | str, base_model: str | None) -> dict[str, Any]:
    """``adapter_config.json``: a LoRA on a causal LM as PEFT writes it (the fields PEFT fills with defaults
    when absent are left out, but for the ones that change the math, stated)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": facts.rank,
        "lora_alpha": int(facts.alpha) if float(facts.alpha).is_integer() else facts.alpha,
        "lora_dropout": facts.dropout,
        "target_modules": targets,
        "modules_to_save": list(facts.train) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
    }
