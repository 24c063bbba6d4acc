"""The compute efficiency of a measured run, for the step-time model (``lightning-par-advise --calibrate``).

The step-time model prices compute as the model's FLOPs over ``peak x efficiency`` (``step_time.py``);
a flat 50% is a guess. A run's ``summary.json`` holds what it did: the model FLOPs of one optimizer step
(``flops_per_step``, counted by torch's FLOP counter on a meta copy of the model), its median step time and
its world size. Their ratio over the device's peak is the efficiency that model reaches on that device,
the exposed communication and any bubble included (calibrate from a single-device run to measure compute
alone). A run with full activation checkpointing recomputes its forward: where its FLOPs were counted on a
meta copy of the model (``flops_method``, no recomputation in it) they are counted as the step model counts
them, 4/3 of the plain step's (the setting read from the run's ``.hydra/config.yaml``); a count measured
on a real step has the recomputation already, and selective checkpointing recomputes no matmul.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: the matmul dtypes the peak is quoted for; an fp32 (TF32) step runs at half of it, as step_time.py prices it
_HALF_PEAK = ("float32",)


@dataclass(frozen=True)
class Calibration:
    efficiency: float
    run: str
    step_s: float
    tflops_per_device: float  # what the run reached
    peak_tflops: float

    def line(self) -> str:
        return (f"Efficiency: {self.efficiency:.4g}, calibrated from {self.run} ({self.tflops_per_device:.3g} TFLOP/s per "
                f"device in a {self.step_s:.4g} s step, of a {self.peak_tflops:g} TFLOP/s peak)")


def calibrate(run_dir: str | Path, peak_tflops: float) -> Calibration:
    """The efficiency ``run_dir``'s measured step reached on a device of ``peak_tflops``; ValueError (one
    line) where the run holds no measured step, or reached more than the peak (the wrong device's peak)."""
    run = Path(run_dir)
    path = run / "summary.json"
    if not path.is_file():
        raise ValueError(f"--calibrate: {path} does not exist (give a finished run's directory)")
    summary = json.loads(path.read_text())
    flops, step_s, world = summary.get("flops_per_step"), summary.get("step_time_s"), summary.get("world_size")
    if not flops or not step_s or not world:
        raise ValueError(f"--calibrate: {path} holds no measured step (flops_per_step {flops}, step_time_s {step_s}); "
                         "train a few more steps")
    if summary.get("flops_method") == "meta copy" and _fully_checkpointed(run):
        flops *= 4 / 3
    peak = peak_tflops * (0.5 if summary.get("matmul_dtype") in _HALF_PEAK else 1.0)
    reached = flops / world / step_s / 1e12
    efficiency = reached / peak
    if not 0 < efficiency <= 1:
        raise ValueError(f"--calibrate: {run} reached {reached:.3g} TFLOP/s per device, more than the {peak:g} "
                         "the peak allows: give the peak of the device it ran on (--peak-tflops)")
    return Calibration(efficiency, str(run), step_s, reached, peak)


def _fully_checkpointed(run: Path) -> bool:
    """Whether the run recomputed every block whole (``strategy.activation_checkpointing`` true or full)."""
    config = run / ".hydra" / "config.yaml"
    if not config.is_file():
        return False
    from omegaconf import OmegaConf

    return OmegaConf.load(config).get("strategy", {}).get("activation_checkpointing", False) in (True, "true", "full")
