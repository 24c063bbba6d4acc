"""transformers' own ``from_pretrained(DIR)`` under a lightning_par strategy: inside the strategy's
meta-device init context it builds the model on the meta device and marks it ``Pretrained(DIR)``, so
materialisation fills each rank's shards (``parallel/init/weights.py``) instead of loading it whole.
This is the one place that patches transformers."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightning_par.parallel.contract import mark_pretrained
from lightning_par.parallel.init.weights import SafetensorsWeights, WeightsError, check_pretrained


#: ``from_pretrained`` keywords the meta-device build takes, or that an Auto class passes on whatever the
#: call (others: one line pointing at the alternative)
_META_KWARGS = ("config", "dtype", "torch_dtype", "attn_implementation", "local_files_only", "trust_remote_code",
                "_from_auto", "_from_pipeline", "adapter_kwargs", "revision", "_commit_hash")
_IN_STRATEGY_INIT = contextvars.ContextVar("lightning_par_strategy_init", default=False)


def in_strategy_init() -> bool:
    """Whether a lightning_par strategy's meta-device init context is active (it fills pretrained weights)."""
    return _IN_STRATEGY_INIT.get()


@contextmanager
def transformers_from_pretrained_on_meta() -> Iterator[None]:
    """Inside (a strategy's meta-device init context), transformers' own ``from_pretrained(DIR)`` on a
    local directory -- a model class's, or an Auto class's, which resolves the class and calls it --
    builds the model on the meta device and marks it ``Pretrained(DIR)``, so the strategy fills each
    rank's shards: what it would otherwise refuse under a meta device ("an anti-pattern"). Keywords
    beyond the build's (``_META_KWARGS``) are accepted only at their no-op values (None, False: what
    an Auto class passes on). Only when transformers is already imported (the user's code imports
    it); restored on exit."""
    import sys

    if "transformers" not in sys.modules:
        token = _IN_STRATEGY_INIT.set(True)
        try:
            yield
        finally:
            _IN_STRATEGY_INIT.reset(token)
        return
    from transformers import AutoConfig, PreTrainedModel

    def build(cls: type, directory: Any, kwargs: dict) -> torch.nn.Module:
        unknown = sorted(k for k, v in kwargs.items() if k not in _META_KWARGS and v not in (None, False))
        path = Path(str(directory))
        if unknown or not (path / "config.json").is_file():
            why = f"the keywords {', '.join(unknown)}" if unknown else f"{directory} (not a local save_pretrained directory)"
            raise WeightsError(f"{cls.__name__}.from_pretrained under a lightning_par strategy cannot take {why}; "
                               "use lightning_par.models.from_pretrained(DIR) in configure_model")
        config = kwargs.get("config") or AutoConfig.from_pretrained(str(path), local_files_only=True)
        options = {k: kwargs[k] for k in ("attn_implementation",) if k in kwargs}
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        # a dtype asked for, else the run's (Lightning's precision sets the default), not config.json's
        options["dtype"] = dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()
        net = cls._from_config(config, **options)
        check_pretrained(net, SafetensorsWeights(path))
        return mark_pretrained(net, str(path))

    saved = PreTrainedModel.__dict__["from_pretrained"]
    PreTrainedModel.from_pretrained = classmethod(lambda cls, d, *a, **kw: build(cls, d, _args(a, kw)))
    token = _IN_STRATEGY_INIT.set(True)
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = saved
        _IN_STRATEGY_INIT.reset(token)


def _args(args: tuple, kwargs: dict) -> dict:
    if args:  # model_args for the model's __init__: not a layout the meta build can honour
        raise WeightsError("from_pretrained under a lightning_par strategy takes keywords only; use "
                           "lightning_par.models.from_pretrained(DIR) in configure_model")
    return kwargs
