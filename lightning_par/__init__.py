"""lightning_par: PyTorch Lightning strategies for every way of spreading training over devices.

Layers (each knows only the ones below it): ``parallel`` (plain torch), ``strategies`` (Lightning
plumbing), ``models``, ``data``, ``callbacks``, ``estimate``; ``run.py`` + ``conf/`` on top.
"""

__version__ = "0.1.0"


class ConfigError(ValueError):
    """A user-facing configuration mistake, reported as one line before any process starts."""
