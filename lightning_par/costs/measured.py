"""Device classes and the compute efficiency measured on them: the step-time model's default.

The step-time model prices compute as FLOPs over ``peak x efficiency`` (``step_time.py``). A flat 50%
was a guess, and a flattering one: on one H200 a 1.2B Llama trains at 37.8% MFU, in lightning_par as in
a plain loop (36.9%) and transformers' Trainer (35.0%). The default efficiency is now the MFU of our own
measured runs (summary.json's ``mfu``: the model's FLOPs by torch's FLOP counter, the same count as
``step_time.flops_per_token``, over the measured median step and the dense peak), interpolated in the
logarithm of the parameter count between the runs of the asked device's family, held at the nearest
run outside their range: small models spend more of their step outside large matmuls (the
vocabulary head, attention at their sequence length, launch overhead).

Where no run was measured on the device's family, the runs of every family are used, and the advisor
says so. ``--efficiency`` or ``--calibrate RUN_DIR`` (``calibration.py``) replace the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    """A device class the advisor can be told (``--gpu``): datasheet figures, without sparsity."""

    name: str  #: as torch names the device: its dense peak is read from ``core/devices.DENSE_PEAKS``
    family: str  #: the chip generation whose measured runs apply
    memory_gib: float  #: what one device holds
    float8_tflops: float | None  #: dense float8; None: no float8 matmuls (before compute capability 8.9)

    @property
    def peak_tflops(self) -> float:
        """Dense bf16 TFLOP/s: the MFU table's own figure, so the advisor and a run's MFU share one peak."""
        import torch

        from lightning_par.core.devices import dense_peak_flops

        return dense_peak_flops(self.name, torch.bfloat16) / 1e12


GPUS: dict[str, GPU] = {
    "h100": GPU("NVIDIA H100 SXM 80GB", "hopper", 80.0, 1979.0),
    "h100-pcie": GPU("NVIDIA H100 PCIe 80GB", "hopper", 80.0, 1513.0),
    "h200": GPU("NVIDIA H200 141GB", "hopper", 139.0, 1979.0),
    "a100": GPU("NVIDIA A100 80GB", "ampere", 80.0, None),
    "l40s": GPU("NVIDIA L40S 48GB", "ada", 48.0, 733.0),
    "b200": GPU("NVIDIA B200", "blackwell", 180.0, 4500.0),
}
DEFAULT_GPU = "h100"


@dataclass(frozen=True)
class MeasuredRun:
    gpu: str  #: a key of ``GPUS``
    params: float  #: the model's parameters
    mfu: float  #: summary.json's mfu of the run
    what: str  #: the model, batch, precision and program
    where: str  #: where the measurement is written down


#: lightning_par's own runs on one GPU, bf16-mixed, fused AdamW, median step (no estimate among them)
MEASURED: tuple[MeasuredRun, ...] = (
    MeasuredRun("h100", 163e6, 0.243, "gpt2 (163M), 16 x 1024 tokens, lightning_par single",
                "docs/benchmarks.md, GPU tables (bench_loop.py on one H100 80GB HBM3)"),
    MeasuredRun("h200", 1.236e9, 0.378, "hf_llama_1b (1.24B), 4 x 2048 tokens, lightning_par single",
                "docs/costs-and-advisor.md, measured efficiency (one H200)"),
)


@dataclass(frozen=True)
class Efficiency:
    value: float
    runs: tuple[MeasuredRun, ...]  #: the runs it comes from
    borrowed: bool  #: no run on the asked device's family: every family's runs

    def line(self, gpu: str) -> str:
        runs = "; ".join(f"{r.what} on {GPUS[r.gpu].name}: {r.mfu:.1%}" for r in self.runs)
        note = f" (none measured on the {GPUS[gpu].family} generation: other generations' runs)" if self.borrowed else ""
        return f"Efficiency: {self.value:.3g}, from measured MFU{note}: {runs}"


def measured_efficiency(gpu: str, params: float) -> Efficiency:
    """The default efficiency of a ``params``-parameter model on ``gpu`` (a ``GPUS`` key)."""
    family = GPUS[gpu].family
    runs = [r for r in MEASURED if GPUS[r.gpu].family == family]
    borrowed = not runs
    runs = sorted(runs or MEASURED, key=lambda r: r.params)
    x = math.log(params)
    if x <= math.log(runs[0].params):
        return Efficiency(runs[0].mfu, (runs[0],), borrowed)
    if x >= math.log(runs[-1].params):
        return Efficiency(runs[-1].mfu, (runs[-1],), borrowed)
    for lo, hi in zip(runs, runs[1:]):
        if x <= math.log(hi.params):
            w = (x - math.log(lo.params)) / (math.log(hi.params) - math.log(lo.params))
            return Efficiency(lo.mfu + w * (hi.mfu - lo.mfu), (lo, hi), borrowed)
    raise AssertionError("unreachable: params within the runs' range")


def gpu_class(device_name: str) -> str | None:
    """The ``GPUS`` key of a device as ``torch.cuda.get_device_name`` names it, or None -- also for the
    variants the table does not list (GH200, the NVL cards, a 40 GB A100), whose memory or peak differ."""
    name = device_name.lower()
    if any(word in name for word in ("gh200", "nvl", "40gb")):
        return None
    for key in ("h100-pcie", "h100", "h200", "a100", "l40s", "b200"):
        words = key.split("-")
        if all(w in name for w in words):
            return key
    return None
