"""Cost models: activation memory of today's kernels (``activations.py``) and the per-rank peak of
a training step (``peak.py``). ``lightning_par.estimate`` and the advisor are built on them."""
