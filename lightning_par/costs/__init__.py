"""Cost models: the one shape of a decoder (``shape.py``) and its parameter counts (``counting.py``),
activation memory of today's kernels (``activations.py``) and the per-rank peak of a training step
(``peak.py``). ``lightning_par.costs.estimate`` and the advisor are built on them."""
