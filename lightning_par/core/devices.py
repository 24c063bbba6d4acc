"""Dense peak FLOP/s of common accelerators, by the dtype the matmuls run in (the denominator of MFU).

Why our own table before Lightning's ``get_available_flops``: Lightning's lists the H200 with its
2:4-sparsity figures (2.0e15 bf16, twice the dense peak) and only under names with "sxm1"/"nvl1",
which the H200's device name ("NVIDIA H200") does not contain; it reads "NVIDIA L40S" as an L4
(121 TFLOP/s bf16 instead of 362); and it has no Blackwell entry. Other GPUs fall back to it.

Figures are NVIDIA's datasheet numbers without sparsity. ``tf32`` applies to fp32 matmuls when
``torch.get_float32_matmul_precision()`` is not "highest".
"""

from __future__ import annotations

import torch

from lightning_par.core.dtypes import short_name

_T = 1e12
#: (name patterns, lower-case substrings of torch.cuda.get_device_name, all must match) -> peaks
DENSE_PEAKS: list[tuple[tuple[str, ...], dict[str, float]]] = [
    (("b200",), {"bf16": 2250 * _T, "fp16": 2250 * _T, "tf32": 1100 * _T, "fp32": 80 * _T}),
    (("h200", "nvl"), {"bf16": 835 * _T, "fp16": 835 * _T, "tf32": 418 * _T, "fp32": 60 * _T}),
    (("h200",), {"bf16": 989 * _T, "fp16": 989 * _T, "tf32": 494.7 * _T, "fp32": 66.9 * _T}),
    (("h100", "nvl"), {"bf16": 835 * _T, "fp16": 835 * _T, "tf32": 418 * _T, "fp32": 60 * _T}),
    (("h100", "pcie"), {"bf16": 756 * _T, "fp16": 756 * _T, "tf32": 378 * _T, "fp32": 51.2 * _T}),
    (("h100",), {"bf16": 989 * _T, "fp16": 989 * _T, "tf32": 494.7 * _T, "fp32": 66.9 * _T}),  # SXM (HBM3)
    (("a100",), {"bf16": 312 * _T, "fp16": 312 * _T, "tf32": 156 * _T, "fp32": 19.5 * _T}),
    (("l40s",), {"bf16": 362 * _T, "fp16": 362 * _T, "tf32": 183 * _T, "fp32": 91.6 * _T}),
]

def dense_peak_flops(device_name: str, dtype: torch.dtype, *, tf32: bool = False) -> float | None:
    """The dense peak of ``device_name`` for matmuls in ``dtype`` from our table, else None."""
    name = device_name.lower()
    key = short_name(dtype)  # bf16, fp16, fp32 (fp64 and others: no entry)
    if key == "fp32" and tf32:
        key = "tf32"
    for patterns, peaks in DENSE_PEAKS:
        if all(p in name for p in patterns):
            return peaks.get(key) if key else None
    return None


def peak_flops_per_device(device: torch.device, dtype: torch.dtype, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one ``device`` for matmuls in ``dtype``: the override (TFLOP/s) if given, our
    dense table, then Lightning's table; None on CPU (no meaningful peak) or an unknown GPU."""
    if override_tflops:
        return float(override_tflops) * _T
    if device.type != "cuda":
        return None
    tf32 = dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest"
    ours = dense_peak_flops(torch.cuda.get_device_name(device), dtype, tf32=tf32)
    if ours is not None:
        return ours
    from lightning.fabric.utilities.throughput import get_available_flops

    return get_available_flops(device, dtype)
