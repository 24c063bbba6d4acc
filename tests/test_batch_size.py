"""``mode=find_batch_size`` (lightning_par/modes/batch_size.py).

The search itself on a known threshold (how many tries, the answer), the accumulation that keeps the
global batch, and one real search under zero3 at 2 CPU ranks against a memory cap: the cap is put
halfway between the measured peaks of micro-batches 1 and 8 (so the answer lies strictly inside),
and the test checks that the picked size's measured peak is under the cap, the next size up was
tried and exceeds it, and that summary.json and the printed command carry the result.
"""

from __future__ import annotations

import json

import pytest

from lightning_par import ConfigError
from lightning_par.modes.batch_size import GiB, accumulation_for, run_try, search
from tests.helpers import run_cli

pytestmark = pytest.mark.timeout(900)  # one search: a handful of 2-rank training jobs in a row
# a 32K vocabulary makes the micro-batch move the peak by far more than the process's own noise: the
# logits and the fp32 loss buffers are B x 128 x 32768 x 4 bytes each (16 MiB per sample); with
# gpt_tiny's 256 tokens micro-batches 1 and 8 measured the same peak RSS (the runtime's own ~485 MiB)
JOB = ["experiment=quick", "data.seq_len=128", "+model.vocab_size=32768", "strategy=zero3", "trainer.devices=2"]


@pytest.mark.parametrize("threshold,seed", [(1, 1), (5, 1), (5, 64), (37, 8), (64, 64), (100, 2)])
def test_search_finds_the_largest_fitting_size(threshold, seed):
    calls = []

    def fits(m):
        calls.append(m)
        return m <= threshold

    assert search(fits, seed, limit=64) == min(threshold, 64)
    assert len(calls) == len(set(calls)) <= 2 * 7  # no size tried twice; doubling + bisection over 1..64


def test_search_reports_nothing_fits():
    assert search(lambda m: False, 16, limit=64) == 0


def test_accumulation_keeps_the_global_batch():
    assert accumulation_for(64, 2, 32) == (1, 32)
    assert accumulation_for(64, 2, 10) == (4, 8)  # 32 per rank: 8 x 4, the fewest steps with micro <= 10
    assert accumulation_for(48, 4, 5) == (3, 4)
    with pytest.raises(ConfigError, match="not divisible"):
        accumulation_for(10, 4, 8)


@pytest.mark.slow
def test_cpu_needs_a_cap(tmp_path):
    proc = run_cli(["mode=find_batch_size", *JOB], tmp_path, timeout=120, check=False)
    assert proc.returncode == 2 and "needs find_batch_size.max_memory_gb" in proc.stderr


@pytest.mark.slow
def test_zero3_picks_the_largest_size_under_the_cap(tmp_path):
    # a cap between the peaks at micro-batches 2 and 4: the search doubles 1, 2, 4 (over) and bisects to 3
    small = run_try(JOB, 2, 2, 2, str(tmp_path / "calibrate"), 240, None, on_cuda=False)
    large = run_try(JOB, 4, 2, 2, str(tmp_path / "calibrate"), 240, None, on_cuda=False)
    assert large.peak_bytes > small.peak_bytes, (small, large)  # activations grow with the micro-batch
    cap = (small.peak_bytes + large.peak_bytes) / 2
    proc = run_cli(["mode=find_batch_size", *JOB, f"find_batch_size.max_memory_gb={cap / GiB}",
                    "find_batch_size.max_micro_batch=8"], tmp_path / "find", timeout=600)
    with open(tmp_path / "find" / "summary.json") as f:
        result = json.load(f)["find_batch_size"]
    tries = {t["micro_batch_size"]: t for t in result["tries"]}
    best = result["max_micro_batch_size"]
    assert 2 <= best < 4 and 3 in tries, result  # found by bisection between 2 (fits) and 4 (over)
    assert tries[best]["fits"] and tries[best]["peak_bytes"] <= cap
    assert not tries[best + 1]["fits"] and tries[best + 1]["peak_bytes"] > cap
    # global batch 8 over 2 ranks: 4 per rank, in the fewest accumulation steps whose micro-batch fits
    k = next(k for k in (1, 2, 4) if 4 // k <= best)
    assert (result["accumulate_grad_batches"], result["micro_batch_size"]) == (k, 4 // k)
    assert f"trainer.accumulate_grad_batches={k}" in proc.stdout and "strategy=zero3" in result["command"]
    # the printed command trains at the global batch it was found for (it used to drop it: micro-batch 1)
    assert "data.global_batch_size=8" in result["command"].split() and result["command"] in proc.stdout
    assert result["command"].startswith("lightning-par ")  # the installed command, not python run.py
