"""``model.attn_implementation`` against the device, before any process starts: the model names its attention
backend (``cost_shape()``'s ``attn_implementation`` and ``dropout``: our GPT / MoE and ``HFCausalLM``), and
``models/attention.check_device`` says whether the run's accelerator and precision can run it (CPU: sdpa,
sdpa_flash without dropout, sdpa_math, eager; CUDA: flash and cuDNN from compute capability 8.0 with fp16/bf16).
The name itself was checked by the model's constructor. Entry layer: called by ``train.validate``, beside its
accelerator and precision checks (float8's device check is ``run/float8_option.py``'s)."""

from __future__ import annotations

from typing import Any

from lightning_par import ConfigError


def check_attention(model: Any, accelerator: str, precision: str) -> None:
    """One line (``ConfigError``) when the model's attention backend cannot run on ``accelerator`` at
    ``precision``; a model that declares no backend (no ``cost_shape``, or none in it) is not checked."""
    declare = getattr(model, "cost_shape", None)
    declared = declare(None) if callable(declare) else None
    name = declared.get("attn_implementation") if isinstance(declared, dict) else None
    if name is None:
        return
    from lightning_par.models.attention import check_device

    try:
        check_device(name, accelerator, precision=precision, dropout=float(declared.get("dropout") or 0.0))
    except ValueError as e:
        raise ConfigError(f"model.{e}") from None
