"""The one dtype table: names <-> torch dtypes <-> bytes, and Lightning precision strings -> the
dtype parameters are stored in and the dtype matmuls run in.

Every layer reads dtypes from here (strategies' ``param_dtype``/``reduce_dtype``, the throughput
callback's MFU peak, the device peak table, the estimator's bytes per parameter and per activation,
``mode=estimate``'s FSDP gather size). Plain torch: no Lightning or Hydra import, so any module may
import it.

    name (any spelling)                        dtype            bytes
    bf16 bfloat16 torch.bfloat16               torch.bfloat16   2
    fp16 float16 half torch.float16 ...        torch.float16    2
    fp32 float32 float torch.float32 ...       torch.float32    4
    fp64 float64 double torch.float64 ...      torch.float64    8

    precision                   param    compute   (``autocast``: param != compute)
    32-true (32)                fp32     fp32
    bf16-mixed (bf16)           fp32     bf16      autocast over fp32 weights
    16-mixed (16)               fp32     fp16      autocast over fp32 weights (+ gradient scaler)
    bf16-true / 16-true         bf16/16  bf16/16
    64-true (64)                fp64     fp64
    transformer-engine          bf16     bf16      TE's own layers run fp8; the rest bf16
    transformer-engine-float16  fp16     fp16
    paper-mixed                 fp16     fp16      + an fp32 master copy (the ZeRO paper's; estimator only)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DTYPES", "NAMES", "PRECISIONS", "Precision", "canonical_precision", "dtype_bytes", "parse_dtype",
           "precision", "short_name", "to_dtype"]

#: the short name of each dtype (the first of its spellings; the device peak table's keys)
NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                                 torch.float64: "fp64"}
_SPELLINGS: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("bf16", "bfloat16"),
    torch.float16: ("fp16", "float16", "half"),
    torch.float32: ("fp32", "float32", "float"),
    torch.float64: ("fp64", "float64", "double"),
}
#: every accepted spelling (lower case; ``torch.<name>`` too) -> dtype
DTYPES: dict[str, torch.dtype] = {s: d for d, names in _SPELLINGS.items() for n in names
                                  for s in (n, f"torch.{n}")}


def to_dtype(value: str | torch.dtype, what: str = "dtype") -> torch.dtype:
    """``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"``, ``torch.bfloat16`` ... -> ``torch.bfloat16``;
    ValueError (one line) for a name the table lacks."""
    if isinstance(value, torch.dtype):
        return value
    return _lookup(value, what, "")


def parse_dtype(value: str | torch.dtype | None, what: str = "dtype") -> torch.dtype | None:
    """``to_dtype`` that lets None (not set) through: strategies' ``param_dtype`` / ``reduce_dtype``."""
    if value is None or isinstance(value, torch.dtype):
        return value
    return _lookup(value, what, " or null")


def _lookup(value: str, what: str, also: str) -> torch.dtype:
    dtype = DTYPES.get(str(value).strip().lower())
    if dtype is None:
        aliases = ", ".join(n for n in DTYPES if n not in NAMES.values() and "." not in n)
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(NAMES.values())}{also} "
                         f"(also spelled {aliases}, torch.<name>)")
    return dtype


def dtype_bytes(value: str | torch.dtype) -> int:
    """Bytes per element: ``"bf16"`` -> 2, ``torch.float32`` -> 4 (any torch dtype; names from the table)."""
    return to_dtype(value).itemsize


def short_name(dtype: torch.dtype) -> str | None:
    """``torch.bfloat16`` -> ``"bf16"``; None for a dtype outside the table (integers, fp8 ...)."""
    return NAMES.get(dtype)


@dataclass(frozen=True)
class Precision:
    """What a precision setting stores and computes in."""

    param: torch.dtype  # parameters, their gradients and the optimizer state
    compute: torch.dtype  # matmuls (and most activations)
    master: torch.dtype | None = None  # an extra master copy of the parameters (paper-mixed: fp32)

    @property
    def autocast(self) -> bool:
        """Compute in a lower dtype than the parameters (Lightning's ``*-mixed``)."""
        return self.param != self.compute


_F32, _BF16, _F16, _F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
#: Lightning's precision strings (and the estimator's ``paper-mixed``)
PRECISIONS: dict[str, Precision] = {
    "32-true": Precision(_F32, _F32),
    "bf16-mixed": Precision(_F32, _BF16),
    "16-mixed": Precision(_F32, _F16),
    "bf16-true": Precision(_BF16, _BF16),
    "16-true": Precision(_F16, _F16),
    "64-true": Precision(_F64, _F64),
    "transformer-engine": Precision(_BF16, _BF16),
    "transformer-engine-float16": Precision(_F16, _F16),
    "paper-mixed": Precision(_F16, _F16, master=_F32),
}
#: Lightning's short forms (``Trainer(precision=16)`` is 16-mixed)
_SHORT = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}


def canonical_precision(value: str | int) -> str:
    """Lightning's short forms to their full names (``"bf16"`` -> ``"bf16-mixed"``, ``32`` ->
    ``"32-true"``); other strings unchanged."""
    return _SHORT.get(str(value), str(value))


def precision(value: str | int) -> Precision:
    """The ``Precision`` of a Lightning precision string (short forms too); ValueError (one line) else."""
    name = canonical_precision(value)
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {value!r}; choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]
