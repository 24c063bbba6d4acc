"""``compile``: every block compiled in place (``compile=true``, the scope ``blocks``) or the whole model
and its loss (``compile=model``) by the one ordered function (after tensor parallel and checkpointing,
before FSDP/DDP), under every kind of strategy, with loss parity.

Two 2-rank multiruns (gpt_tiny, fp32, 12 AdamW steps) -- blocks: zero2, tensor_parallel, pipeline;
model: ddp, fsdp, pipeline -- against the eager single-device run of the same config. (``compile=model`` on one
device: test_bench_gpu.py's dry run, Dynamo's eager backend, ends at the eager single run's loss.)

The blocks run through inductor, the default backend: its C++ kernels may reorder float math; measured on this
CPU the largest relative deviation from the eager losses is 1.1e-7 (pipeline), 1.0e-7 (ddp, fsdp), 9e-8
(single) -- the same size as the eager strategies' own deviation -- so the bound is the eager parity bound,
rtol 1e-5, about 100x the measurement and far below what a wrongly compiled block (wrong gradients) moves.
(Inductor also runs in test_float8's blocks compiled after float8 under fsdp, and in torchao's 8-bit AdamW.)

The whole model runs through ``backend=aot_eager`` (``compile={backend:aot_eager,scope:model}``: torch.compile's
keyword arguments, the scope among them): what composing the whole model with a strategy takes -- Dynamo's graphs
of each stage between FSDP's and DDP's hooks, and of the loss, and AOTAutograd's joint forward and backward
graphs, their functionalisation and partition -- without inductor's code generation, whose kernels are the
blocks' kinds. Inductor's C++ compilation is most of a compiled CPU run where its cache is cold, as in every
fresh environment (``.ci/run``: its kernels are keyed by the compiler's command line, which names the
environment's include directories): the whole-model sweep took 65 s with inductor and 41 s with aot_eager there
(the same with a warm cache: 35 s, 37 s).
"""

from __future__ import annotations

import pytest

from tests.helpers import assert_losses_match, run_cli
from tests.sweeps import by_strategy, single_refs, sweep

pytestmark = pytest.mark.timeout(900)

BLOCKS = ("compile=true", "strategy=zero2,tensor_parallel,pipeline", "trainer.devices=2")
MODEL = ("compile={backend:aot_eager,scope:model}", "strategy=ddp,fsdp,pipeline", "trainer.devices=2")


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    """(scope, strategy) -> summary."""
    return {**{("blocks", k): v for k, v in by_strategy(sweep(*BLOCKS)).items()},
            **{("model", k): v for k, v in by_strategy(sweep(*MODEL)).items()}}


@pytest.mark.slow
def test_compiled_strategies_match_the_eager_single_run(compiled):
    eager, _ = single_refs()
    assert eager["compile"] is None  # the reference really is eager
    assert len(compiled) == 6, list(compiled)
    for (_, name), summary in compiled.items():
        assert summary["world_size"] == 2, summary
        assert_losses_match(summary, eager, rtol=1e-5)


@pytest.mark.slow
def test_compile_reaches_every_block_or_the_whole_model_and_produces_graphs(compiled):
    for (scope, name), summary in compiled.items():
        facts = summary["compile"]
        assert facts["scope"] == scope, (name, facts)
        if scope == "blocks":  # gpt_tiny has 2 blocks; a pipeline stage holds one of them (rank 0's stage is reported)
            assert facts["modules"] == (1 if name == "pipeline" else 2), (name, facts)
            assert facts["graphs"] >= 1, (name, facts)  # Dynamo really traced something
        else:  # one module compiled whole (the model, or rank 0's stage); the loss is a graph of its own
            assert facts["modules"] == 1, (name, facts)
            assert facts["graphs"] >= (1 if name == "pipeline" else 2), (name, facts)


def test_a_bad_compile_option_is_one_line(tmp_path):
    proc = run_cli(["experiment=quick", "compile=fast"], tmp_path, timeout=120, check=False)
    assert proc.returncode == 2  # the app's exit status for a configuration error
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["error: compile='fast': expected true, false, blocks, model or torch.compile's keyword "
                     "arguments (e.g. compile={mode:max-autotune-no-cudagraphs,scope:model})"], proc.stderr[-2000:]
