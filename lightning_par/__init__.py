"""lightning_par: PyTorch Lightning strategies for every way of spreading training over devices.

Layers (each knows only the ones below it): ``parallel`` (plain torch), ``strategies`` (Lightning
plumbing), ``models``, ``data``, ``callbacks``, ``estimate``; ``run.py`` + ``conf/`` on top.
"""

__version__ = "0.1.0"


class ConfigError(ValueError):
    """A user-facing configuration mistake, reported as one line before any process starts (or, from
    a strategy's setup, before any collective: then every rank raises the same error)."""

    #: raised by every rank alike (the launcher then does not blame a rank that exited with it)
    all_ranks = True
