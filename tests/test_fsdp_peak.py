"""The FSDP per-rank peak (``costs/peak.py``) against torch's ``FSDPMemTracker`` at 2 and 4 ranks, on
four GPT shapes (the loss's backward, the blocks' and a large vocabulary's moments), for zero3, fsdp,
fsdp with bf16 gathers and fp32 reduce-scatters under a 32-true run, hsdp (at 4 ranks) and, at 2
ranks, fsdp with bf16 gathers and every large layer in 4 tiles (checkpointed, each a unit: the
advisor's plan for a layer too large to gather; on the first two shapes). ``tests/fsdp_peak_probe.py`` runs the step on
torch's fake process group and fake tensors in one process.

Tolerance: 10% (issue 23's bound). Measured: 0.951-1.069 (the tiled layout at 4 ranks, by hand:
0.946-1.082). It was 1.05-1.19: the estimate kept the root gathered from forward through the loss,
which this repository's FSDP reshards; and with bf16 gathers under 32-true it counted fp32
activations, where the bf16 parameters make them bf16."""

from __future__ import annotations

import json
import sys

import pytest

from tests import launch
from tests.helpers import ROOT

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # multi-process runs


@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp_peak_within_ten_percent_of_fsdp_mem_tracker(ranks):
    done = launch.run([sys.executable, "-m", "tests.fsdp_peak_probe", str(ranks)], capture_output=True,
                          text=True, timeout=500, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == (16 if ranks >= 4 else 14)
    for r in rows:
        ratio = r["estimated"] / r["tracked"]
        assert 0.9 <= ratio <= 1.1, r
    assert {r["moment"] for r in rows} >= {"backward loss", "backward head"}  # both moments are exercised
