"""``python -m lightning_par ...`` is the ``lightning-par`` command (lightning_par/cli.py)."""

from lightning_par.cli import main

if __name__ == "__main__":
    main()
