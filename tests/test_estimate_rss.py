"""The estimator's per-rank peak for tiled runs with bf16 gathers, against the resident memory the run
measures on this CPU: within +-15%.

On a CPU every tensor of a run is resident memory, so the estimate (``mode=estimate``, which on a CPU
includes offloaded states: the host is the device) can be held against ``peak_rss - rss_before_setup``.
glibc's allocator is run with its mmap threshold fixed at 1 MiB: by default it raises the threshold
after large frees and keeps freed heap pages resident, which no tensor-level model sees (the benchmark,
``benchmarks/bench_tiled_rss.py``, shows both allocators; this test runs its cases, scaled down).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers import ROOT

_spec = importlib.util.spec_from_file_location("bench_tiled_rss", ROOT / "benchmarks" / "bench_tiled_rss.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["fsdp", "zero3_offload"])
def test_tiled_bf16_gather_estimate_is_within_15_percent_of_measured_rss(case, tmp_path):
    # a GPT whose large layers dominate (hidden 768, vocabulary 50304, 4 layers), each in 4 tiles, 2 ranks
    common = bench.overrides(hidden=768, layers=4, tiles=4, devices=2)
    predicted = bench.predicted_peak(case, common, tmp_path / "estimate")
    added, _ = bench.measured(case, common, 3, tmp_path / "fit", bench.ALLOCATORS["mmap threshold 1 MiB"])
    ratio = predicted / added
    print(f"{case}: estimate {predicted / 2**20:.1f} MiB / measured {added / 2**20:.1f} MiB = {ratio:.3f}")
    assert 0.85 <= ratio <= 1.15, f"{case}: estimate {predicted / 2**20:.1f} MiB, measured {added / 2**20:.1f} MiB"
