"""Techniques that change the arithmetic of the matmuls: float8 training (``float8``)."""
