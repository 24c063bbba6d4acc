"""lightning_par: PyTorch Lightning strategies for every way of spreading training over devices.

One folder per layer, each importing only the ones before it (docs/architecture.md, tests/test_layers.py):
``core`` (leaf helpers), ``parallel`` (plain torch), ``strategies`` (Lightning plumbing), ``models``, ``data``,
``callbacks`` (measurement), ``costs``, ``run`` (config meets code), and the app: ``cli.py``, ``modes``,
``tools``, ``conf``.
"""

__version__ = "0.1.0"


class ConfigError(ValueError):
    """A user-facing configuration mistake, reported as one line before any process starts (or, from
    a strategy's setup, before any collective: then every rank raises the same error)."""

    #: raised by every rank alike (the launcher then does not blame a rank that exited with it)
    all_ranks = True


def _if_finetune(then: object, otherwise: object, *, _parent_: object, _root_: object) -> object:
    """``${lp.if_finetune:A,B}`` in the Hydra configs: ``A`` when the run fine-tunes a checkpoint
    (``model.pretrained`` set), else ``B``. The fine-tuning defaults (``conf/model/hf_causal_lm.yaml``'s
    ``lr``, ``conf/scheduler/auto.yaml``) are written with it, so a value given on the command line
    replaces the interpolation and wins, and the resolved config (loggers, ``--cfg job --resolve``, the
    child ranks' file) shows the value the run uses. A model node read on its own (no ``model`` above
    it) answers from its own ``pretrained``."""
    from omegaconf import OmegaConf

    pretrained = OmegaConf.select(_root_, "model.pretrained", default=None)
    if pretrained is None and _parent_ is not None and "pretrained" in _parent_:
        pretrained = OmegaConf.select(_parent_, "pretrained", default=None)
    return then if pretrained else otherwise


def _register_resolvers() -> None:
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("lp.if_finetune", _if_finetune, replace=True)


_register_resolvers()  # at import: every entry point (the app, its child ranks, the advisor) imports lightning_par
