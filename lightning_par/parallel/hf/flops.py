"""A Hugging Face MoE model's FLOPs on the meta device: the routed work, or a reason why not.

The throughput callback counts a model's training FLOPs with torch's FLOP counter on a meta copy
(``callbacks/throughput.py``). transformers' MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V3, GPT-OSS, ...) run their experts module -- stacked weights, called as
``experts(hidden_states, top_k_index, top_k_weights)`` -- through the implementation the config
selects (``config._experts_implementation``, dispatched at every call by the
``@use_experts_implementation`` wrapper of ``transformers.integrations.moe``). Neither the default
nor eager can be counted on meta tensors:

- ``grouped_mm`` (the default) calls ``torch.nn.functional.grouped_mm``: its meta kernel accepts bf16
  only, the FLOP counter has no formula for it (the experts would count 0), and its group sizes
  come from the routing's values, which meta tensors do not have;
- ``eager`` loops over the experts that received tokens, found with ``nonzero``: data-dependent,
  so the meta device raises.

``batched_mm`` gathers each (token, choice) pair's expert weights by the top-k indices and runs one
batched matmul per projection. Its shapes depend only on tokens x top_k, so it runs on the meta
device, and the FLOP counter sees exactly the routed work -- every token through its top_k experts:
the same matmuls, on the same weights, as ``grouped_mm`` runs in training (same function, other
kernel). That is why the copy is switched rather than the experts counted analytically from the
config: an analytic count would restate every family's expert layout (gated or not, biases,
transposed stacks, shared experts, dense layers between sparse ones, post-expert norms) beside the
model's own forward, and drift from it; this counts the model's own forward.

Only the counting copy's experts modules are switched, each to a private copy of its config: the
config object itself may be shared with the training model (``from_config`` keeps it), which must
keep the implementation it was built with.

A model with experts that do not go through that dispatch (Llama-4's text experts take every token
scaled by its router score; DBRX, JetMoE, ... loop over experts in Python) would be counted as all
experts on every token, or not at all: ``FlopsUnknown`` says why, and MFU is null, never that number.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from typing import Any

from torch import nn

COUNTING_IMPLEMENTATION = "batched_mm"
# config fields that mean "tokens are routed to experts" (the families' spellings of top-k)
_TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "num_selected_experts")
# a routed-experts module by its class name; shared experts run on every token (dense: counted as is)
_EXPERTS_CLASS = re.compile(r"Expert", re.IGNORECASE)
_SHARED_CLASS = re.compile(r"Shared", re.IGNORECASE)


class FlopsUnknown(Exception):
    """A model whose FLOPs cannot be counted correctly on the meta device (the message: one line why)."""


def dispatches_experts(module: nn.Module) -> bool:
    """Whether ``module``'s forward is transformers' experts-implementation dispatcher (a class decorated
    with ``use_experts_implementation``, its forward not overridden since)."""
    moe = sys.modules.get("transformers.integrations.moe")
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    if moe is None or code is None or not getattr(moe, "__file__", None):
        return False  # the integration was never imported: no class can have been decorated by it
    return (os.path.realpath(code.co_filename) == os.path.realpath(moe.__file__)
            and code.co_name == "forward" and hasattr(module, "config"))


def _top_k(config: Any) -> tuple[str, Any] | None:
    """The first top-k field set in ``config`` or one of its sub-configs, as (name, value)."""
    for cfg in [config, *(getattr(config, k, None) for k in getattr(config, "sub_configs", None) or ())]:
        for key in _TOP_K_KEYS:
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value > 0:
                return key, value
    return None


def _under(path: str, roots: list[str]) -> bool:
    return any(not root or path == root or path.startswith(root + ".") for root in roots)


def route_experts_for_counting(net: nn.Module) -> int:
    """Make ``net`` -- a meta copy built only to be counted -- run each Hugging Face experts module
    with ``batched_mm``, so the FLOP counter sees the routed work; returns how many modules it
    switched (0 for a dense or non-Hugging-Face model). ``FlopsUnknown`` when ``net`` holds a
    Hugging Face MoE whose experts cannot be counted that way."""
    from lightning_par.parallel.hf.plan import is_hf_model

    hf_paths = [path for path, m in net.named_modules() if is_hf_model(m)]
    if not hf_paths:
        return 0
    model = net.get_submodule(hf_paths[0])  # the outermost (named_modules walks parents first)
    name = type(model).__name__
    routed: list[nn.Module] = []
    inside: list[str] = []  # paths of the dispatched modules: their own children are theirs
    for path, module in net.named_modules():
        if not _under(path, hf_paths) or any(path.startswith(p + ".") for p in inside):
            continue  # outside every Hugging Face model (not ours to judge), or inside a dispatched one
        if dispatches_experts(module):
            routed.append(module)
            inside.append(path)
        elif _EXPERTS_CLASS.search(type(module).__name__) and not _SHARED_CLASS.search(type(module).__name__):
            raise FlopsUnknown(f"{name}'s experts ({type(module).__name__} at {path}) do not go through "
                               "transformers' experts implementations, so the routed FLOPs (top-k experts per token) "
                               "cannot be counted on the meta device")
    if not routed:
        top_k = _top_k(getattr(model, "config", None))
        if top_k is not None:
            raise FlopsUnknown(f"{name} routes tokens to experts ({top_k[0]}={top_k[1]}) but none of its modules goes "
                               "through transformers' experts implementations, so the routed FLOPs cannot be counted")
        return 0
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if COUNTING_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        raise FlopsUnknown(f"this transformers has no {COUNTING_IMPLEMENTATION!r} experts implementation to count "
                           f"{name}'s routed FLOPs on the meta device")
    copies: dict[int, Any] = {}
    for module in routed:
        cfg = module.config
        if id(cfg) not in copies:
            copies[id(cfg)] = copy.deepcopy(cfg)  # the original may be the training model's config
            copies[id(cfg)]._experts_implementation = COUNTING_IMPLEMENTATION
        module.config = copies[id(cfg)]
    return len(routed)
