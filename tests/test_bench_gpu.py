"""``benchmarks/bench_gpu.py --dry``: the GPU benchmark's code path on CPU (issue 31), so the command cannot
rot while no GPU is at hand. One run of every row on a tiny Llama (the offload rows on gpt_tiny), fp32, a
few steps; its figures say nothing about a GPU. What it checks is that every row trains, that the rows
which change no arithmetic (compile with Dynamo's eager backend, chunked loss, selective checkpointing,
fsdp at one rank) end at ``single``'s loss, and that the estimate and advisor parts answer."""

from __future__ import annotations

import json
import math
import sys

import pytest

from tests import launch
from tests.helpers import ROOT

pytestmark = pytest.mark.timeout(600)

SCRIPT = ROOT / "benchmarks" / "bench_gpu.py"


@pytest.mark.slow
def test_bench_gpu_dry_runs_every_row(tmp_path):
    proc = launch.run([sys.executable, str(SCRIPT), "--dry", "--out", str(tmp_path)], capture_output=True,
                      text=True, timeout=540, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "bench_gpu.json").read_text())
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_gpu import ROWS
    finally:
        sys.path.remove(str(SCRIPT.parent))
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ROWS, list(rows)
    for name, r in rows.items():
        assert r["error"] is None, (name, r["error"])
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and math.isfinite(r["final_loss"]), (name, r)
        assert r["mfu"] is None and r["peak_bytes"] is None, (name, r)  # a CPU has no peak FLOP/s nor allocator
    single = rows["single"]["final_loss"]
    for same in ("single+compile", "single+chunked CE", "single+selective AC", "fsdp"):
        assert rows[same]["final_loss"] == pytest.approx(single, rel=1e-5), (same, rows[same], single)
    for changed in ("single+float8", "single+all", "fsdp+all"):  # float8 (emulated) rounds the matmuls' inputs
        assert rows[changed]["final_loss"] == pytest.approx(single, rel=1e-2), (changed, rows[changed], single)
    assert rows["disk offload"]["final_loss"] == pytest.approx(rows["host offload"]["final_loss"], rel=1e-6)
    assert [e["row"] for e in result["estimates"]] == ["single", "fsdp", "single+chunked CE", "single+selective AC"]
    assert all(e["estimate_bytes"] > 0 and e["measured_bytes"] is None for e in result["estimates"])
    advisor = result["advisor"]
    assert advisor["plan"] == "single" and advisor["predicted_s"] > 0, advisor
    table = (tmp_path / "bench_gpu.md").read_text()
    assert all(f"| {name} |" in table for name in ROWS), table
