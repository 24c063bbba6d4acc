"""A model from its config node (``model`` of the app's config): Hydra's ``instantiate`` of the node without
the keys that are options of the run rather than arguments of the model's constructor (``RUN_OPTIONS``:
``float8``, applied by the strategy, ``parallel/precision/float8.py``), and the arguments merged under every
model while they are off (``MERGED_ARGUMENTS``: ``chunked_loss``). Every place that builds the configured
model goes through ``instantiate_model``, so a new such option is one entry here."""

from __future__ import annotations

import copy
from typing import Any

#: keys of the ``model`` node that no model constructor takes (the app merges them under every model)
RUN_OPTIONS = ("float8",)
#: constructor arguments the app merges under every model at their off value (``chunked_loss``: ``ParModule``'s):
#: passed on only when set, so a model without that argument builds as long as it stays off
MERGED_ARGUMENTS = {"chunked_loss": False, "lora": {"rank": 0}}


def _off(key: str, value: Any) -> bool:
    off = MERGED_ARGUMENTS[key]
    if isinstance(off, dict):  # a mapping is off when its listed keys are (lora: rank 0)
        return value is None or all(value.get(k) == v for k, v in off.items())
    return value == off


def constructor_config(model_cfg: Any) -> Any:
    """``model_cfg`` without ``RUN_OPTIONS``: a copy that keeps its place in the config (its interpolations,
    ``${data.seq_len}``, still resolve)."""
    from omegaconf import DictConfig, open_dict

    if not isinstance(model_cfg, DictConfig):
        return model_cfg
    dropped = [k for k in RUN_OPTIONS if k in model_cfg]
    dropped += [k for k, off in MERGED_ARGUMENTS.items() if k in model_cfg and _off(k, model_cfg[k])]
    if not dropped:
        return model_cfg
    rest = copy.deepcopy(model_cfg)
    with open_dict(rest):
        for key in dropped:
            rest.pop(key, None)
    return rest


def instantiate_model(model_cfg: Any) -> Any:
    """The configured model, built as the run builds it (``hydra.utils.instantiate``)."""
    from hydra.utils import instantiate

    return instantiate(constructor_config(model_cfg))
