"""``compile=true``: every block compiled in place by the one ordered function (after tensor parallel
and checkpointing, before FSDP/DDP), under every kind of strategy, with loss parity.

One 2-rank multirun (single, ddp, zero2, fsdp, tensor_parallel, pipeline; gpt_tiny, fp32, 12 AdamW
steps) against the eager single-device run of the same config. Compiled kernels (inductor's C++
kernels here) may reorder float math; measured on this CPU the largest relative deviation from the
eager losses is 1.1e-7 (pipeline), 1.0e-7 (ddp, fsdp), 9e-8 (single) -- the same size as the eager
strategies' own deviation -- so the bound is the eager parity bound, rtol 1e-5, about 100x the
measurement and far below what a wrongly compiled block (wrong gradients) moves.
"""

from __future__ import annotations

import pytest

from tests.helpers import assert_losses_match, run_cli
from tests.sweeps import by_strategy, single_refs, sweep

pytestmark = pytest.mark.timeout(900)

COMPILED = ("compile=true", "strategy=single,ddp,zero2,fsdp,tensor_parallel,pipeline", "trainer.devices=2")


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    return by_strategy(sweep(*COMPILED))


@pytest.mark.slow
def test_compiled_strategies_match_the_eager_single_run(compiled):
    eager, _ = single_refs()
    assert eager["compile"] is None  # the reference really is eager
    for name, summary in compiled.items():
        assert summary["world_size"] == (1 if name == "single" else 2), summary
        assert_losses_match(summary, eager, rtol=1e-5)


@pytest.mark.slow
def test_compile_reaches_every_block_and_produces_graphs(compiled):
    for name, summary in compiled.items():
        facts = summary["compile"]
        # gpt_tiny has 2 blocks; a pipeline stage holds one of them (rank 0's stage is reported)
        assert facts["modules"] == (1 if name == "pipeline" else 2), (name, facts)
        assert facts["graphs"] >= 1, (name, facts)  # Dynamo really traced something


def test_a_bad_compile_option_is_one_line(tmp_path):
    proc = run_cli(["experiment=quick", "compile=fast"], tmp_path, timeout=120, check=False)
    assert proc.returncode == 2  # the app's exit status for a configuration error
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["error: compile='fast': expected true, false or torch.compile's keyword arguments "
                     "(e.g. compile={mode:max-autotune-no-cudagraphs})"], proc.stderr[-2000:]
