"""Techniques that trade compute for activation memory: activation checkpointing (``checkpointing``) and
tiling of large linear layers (``tiling``)."""
