"""A model from its config node (``model`` of the app's config): Hydra's ``instantiate`` of the node without
the keys that are options of the run rather than arguments of the model's constructor (``RUN_OPTIONS``:
``float8``, applied by the strategy, ``parallel/precision/float8.py``). Every place that builds the configured
model goes through ``instantiate_model``, so a new such option is one entry here."""

from __future__ import annotations

import copy
from typing import Any

#: keys of the ``model`` node that no model constructor takes (the app merges them under every model)
RUN_OPTIONS = ("float8",)


def constructor_config(model_cfg: Any) -> Any:
    """``model_cfg`` without ``RUN_OPTIONS``: a copy that keeps its place in the config (its interpolations,
    ``${data.seq_len}``, still resolve)."""
    from omegaconf import DictConfig, open_dict

    if not isinstance(model_cfg, DictConfig) or not any(k in model_cfg for k in RUN_OPTIONS):
        return model_cfg
    rest = copy.deepcopy(model_cfg)
    with open_dict(rest):
        for key in RUN_OPTIONS:
            rest.pop(key, None)
    return rest


def instantiate_model(model_cfg: Any) -> Any:
    """The configured model, built as the run builds it (``hydra.utils.instantiate``)."""
    from hydra.utils import instantiate

    return instantiate(constructor_config(model_cfg))
