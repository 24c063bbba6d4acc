"""Small commands beside the app (``python -m lightning_par.tools.<name>``)."""
