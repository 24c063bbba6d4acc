"""Layer 5: measurement callbacks -- memory per rank, throughput/MFU, pipeline bubble, run summary."""

from lightning_par.callbacks.bubble import ActivationMeter, BubbleMonitor
from lightning_par.callbacks.bubble_render import BubbleSweepFigure
from lightning_par.callbacks.memory import MemoryMonitor
from lightning_par.callbacks.summary import CONTRACT_KEYS, RunSummary, format_summary
from lightning_par.callbacks.throughput import ThroughputMonitor

__all__ = ["CONTRACT_KEYS", "ActivationMeter", "BubbleMonitor", "BubbleSweepFigure", "MemoryMonitor", "RunSummary",
           "ThroughputMonitor", "format_summary"]
