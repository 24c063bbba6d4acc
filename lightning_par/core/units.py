"""Byte counts in words: one formatter for every message and report (base layer: no lightning_par import)."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1: ``0 B``, ``782.0 KiB``, ``1.5 MiB``."""
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024:
            return f"{int(v)} B" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} TiB"
