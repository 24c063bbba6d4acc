"""``from_pretrained(DIR)``: a Hugging Face causal LM from a local ``save_pretrained`` directory that the
strategy fills shard by shard.

Inside ``configure_model`` under a lightning_par strategy (the meta device), it returns the model
built from ``DIR/config.json`` on the meta device and marked ``Pretrained(DIR)``: after the strategy
has cut, split and sharded it, materialisation reads each rank's slices of the safetensors files
(``parallel/init/weights.py``), so no rank holds the full model. Anywhere else (a real device: a
plain Trainer, a notebook) it is transformers' own ``from_pretrained``. Either way the checkpoint is
checked against the config first (every tensor present, of the config's shape, none left over),
with one line naming the path when it is not.

transformers' own ``AutoModelForCausalLM.from_pretrained`` refuses to run under a meta device
context; this is the call to use in ``configure_model``::

    def configure_model(self):
        if self.net is None:
            self.net = lightning_par.models.from_pretrained("checkpoints/llama-1b")
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_par.parallel.contract import mark_pretrained
from lightning_par.parallel.hf.from_pretrained import in_strategy_init
from lightning_par.parallel.init.weights import SafetensorsWeights, WeightsError, check_pretrained

_DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout",
                 "summary_first_dropout", "dropout", "activation_dropout")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError("pretrained models need transformers: pip install 'lightning_par[hf]'") from None
    return transformers


def pretrained_config(directory: str | Path, *, attn_implementation: str | None = None, dropout: bool = False,
                      **overrides: Any) -> Any:
    """``DIR/config.json`` as a causal-LM config (one line if it is not one), without dropout unless
    ``dropout``, no KV cache, then ``overrides`` (config fields)."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        what = "is not a directory" if not directory.is_dir() else "has no config.json"
        raise WeightsError(f"pretrained model: {directory} {what} (expected a save_pretrained directory)")
    transformers = _transformers()
    try:
        cfg = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers' and huggingface_hub's validators raise their own types
        why = " ".join(str(e).split()) or type(e).__name__
        raise WeightsError(f"pretrained model: {directory}/config.json cannot be read ({why[:300]})") from None
    if type(cfg) not in transformers.AutoModelForCausalLM._model_mapping:
        raise WeightsError(f"pretrained model: {directory} is a {cfg.model_type!r} model, which "
                           "AutoModelForCausalLM does not know as a causal language model")
    if not dropout:
        for key in _DROPOUT_KEYS:
            if isinstance(getattr(cfg, key, None), float):
                setattr(cfg, key, 0.0)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    return cfg


def build_pretrained(cfg: Any, directory: str | Path, device: torch.device | str | None = None, *,
                     check: bool = True) -> nn.Module:
    """The model of ``cfg`` with the weights of ``directory``: on the meta device, marked for the
    strategy to fill; on a real device, loaded by transformers. The checkpoint is checked first
    (``check=False``: it was already)."""
    auto = _transformers().AutoModelForCausalLM
    device = torch.device(device) if device is not None else _current_device()
    with torch.device("meta"):
        # the run's dtype (Lightning's precision sets the default), not the one config.json was saved in
        meta = auto.from_config(cfg, attn_implementation=cfg._attn_implementation, dtype=torch.get_default_dtype())
    if check:
        check_pretrained(meta, SafetensorsWeights(directory))
    if device.type == "meta":
        return _no_cache_by_default(mark_pretrained(meta, str(directory)))
    net = auto.from_pretrained(str(directory), config=cfg, dtype=torch.get_default_dtype(), local_files_only=True,
                               attn_implementation=cfg._attn_implementation)
    return _no_cache_by_default(net.to(device))


def _no_cache_by_default(net: nn.Module) -> nn.Module:
    """Calls that do not ask for the key/value cache get none: training keeps no cache of every layer's
    keys and values. The config keeps the checkpoint's ``use_cache``, which ``save_pretrained`` writes
    and ``generate`` reads (it passes ``use_cache`` explicitly); ``lightning-par-export`` writes
    ``use_cache: true``, transformers' default. The hook goes on the outermost module whose forward
    names ``use_cache`` (a head class that takes it through ``**kwargs``, as Granite-MoE's, passes it
    on to its base model, which names it)."""
    base = getattr(net, getattr(net, "base_model_prefix", "") or "", None)
    target = next((m for m in (net, base) if isinstance(m, nn.Module)
                   and "use_cache" in inspect.signature(m.forward).parameters), None)
    if target is None:
        return net

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        kwargs.setdefault("use_cache", False)
        return args, kwargs

    target.register_forward_pre_hook(hook, with_kwargs=True)
    return net


def from_pretrained(directory: str | Path, *, attn_implementation: str = "sdpa", dropout: bool = False,
                    **config: Any) -> nn.Module:
    """A causal LM with the weights of the local ``save_pretrained`` directory ``directory``.

    Under a lightning_par strategy (inside ``configure_model``: the meta device) the model is built
    on meta and each rank later reads only its shards; elsewhere it is loaded whole by transformers.
    Dropout is off unless ``dropout=True`` (runs are then deterministic); ``config`` sets further
    config fields (``rope_theta=...``). One line (``WeightsError``) for a directory that is not a
    causal LM's checkpoint or whose tensors do not match its config."""
    cfg = pretrained_config(directory, attn_implementation=attn_implementation, dropout=dropout, **config)
    net = build_pretrained(cfg, directory)
    if any(p.is_meta for p in net.parameters()) and not in_strategy_init():
        raise WeightsError(f"from_pretrained({directory}) on the meta device outside a lightning_par strategy: "
                           "nothing would read the weights (call it in configure_model under an lp_ strategy, "
                           "or on a real device)")
    return net


def _current_device() -> torch.device:
    """The device new tensors go to now (a ``torch.device`` context, e.g. meta, or the default)."""
    with contextlib.suppress(Exception):
        return torch.empty(()).device
    return torch.device("cpu")


__all__ = ["build_pretrained", "check_pretrained", "from_pretrained", "pretrained_config"]
