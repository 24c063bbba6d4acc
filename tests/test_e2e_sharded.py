"""End-to-end: the sharded strategies (zero1, zero2, zero3, zero3_offload, fsdp, hsdp) through run.py.

Loss parity (docs/architecture.md): fp32, same seed and data order -> every strategy's per-step
losses equal the single-device run's. Over the 12 steps of most runs here: rtol 1e-5, atol 1e-6
(``assert_losses_match``); measured differences are ~5e-7 absolute (float32 rounding of reductions
in a different order), identical for every data-parallel strategy. Over a long horizon
(``test_two_ranks_match_single_over_60_steps``, whose sweep the model-parallel tests share) the
runs use SGD, which neither amplifies that rounding nor hides a wrong gradient scale:
``assert_parity_over_horizon``. bf16 runs are compared loosely (atol 2e-2; measured ~1e-3) and
must learn.

The runs are Hydra multiruns shared with other test modules through ``tests/sweeps.py`` (one run
per argument list and test session); this module's own five run one after another in one process
(``sweeps.together``).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import assert_losses_match, composed, run_cli
from tests.sweeps import (
    LONG_STEPS,
    assert_parity_over_horizon,
    by_strategy,
    four_ranks,
    long_parity,
    single_refs,
    sweep,
    together,
    two_ranks_accumulating,
)

pytestmark = pytest.mark.timeout(900)

SHARDED = ("zero1", "zero2", "zero3", "fsdp")

# this module's own sweeps, run one after another in one process when the first is needed (sweeps.together)
DOUBLED = ("strategy=single", f"trainer.max_steps={LONG_STEPS}", "model.optimizer=sgd", "model.lr=0.2")
CLIPPED = ("strategy=zero2,fsdp", "trainer.devices=2", "trainer.gradient_clip_val=0.5")
BF16 = ("strategy=zero2,zero3", "trainer.devices=2", "trainer.precision=bf16-mixed")
FSDP_OPTIONS = ("strategy=fsdp", "trainer.devices=2", "strategy.param_dtype=bf16", "strategy.reduce_dtype=fp32",
                "strategy.units=Block", "strategy.reshard_after_forward=false", "strategy.prefetch=2",
                "strategy.activation_checkpointing=true")
# ++: in a multirun Hydra first composes the default strategy (single), which has no such keys
FSDP_TP_BF16 = ("strategy=fsdp_tp", "trainer.devices=4", "++strategy.param_dtype=bf16", "++strategy.reduce_dtype=fp32")
together(DOUBLED, CLIPPED, BF16, FSDP_OPTIONS, FSDP_TP_BF16)


@pytest.mark.slow
def test_parity_bound_rejects_a_doubled_gradient():
    """SGD (momentum, no weight decay) with twice the learning rate is exactly SGD on a gradient twice
    too large -- what summing instead of averaging over 2 ranks gives. The bound must reject it, and
    at step 2 already."""
    (doubled,) = sweep(*DOUBLED)
    ref = long_parity()["single"]
    with pytest.raises(AssertionError):
        assert_parity_over_horizon(doubled, ref)
    assert doubled["losses"][0] == ref["losses"][0]  # same start: only the update differs
    assert abs(doubled["losses"][1] - ref["losses"][1]) / ref["losses"][1] > 100 * 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", *SHARDED])
def test_two_ranks_match_single_over_60_steps(strategy):
    s = long_parity()[strategy]
    assert s["world_size"] == 2 and long_parity()["single"]["world_size"] == 1
    assert_parity_over_horizon(s, long_parity()["single"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [*SHARDED, "hsdp"])
def test_four_ranks_match_single(strategy):
    s = four_ranks()[strategy]
    assert s["world_size"] == 4 and len(s["memory"]) == 4
    expected_mesh = {"dp_replicate": 2, "dp_shard": 2} if strategy == "hsdp" else {"dp_shard": 4}
    assert s["mesh"] == expected_mesh
    assert_losses_match(s, single_refs()[0])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", *SHARDED, "zero3_offload"])
def test_two_ranks_with_accumulation_and_activation_checkpointing_match_single(strategy):
    s = two_ranks_accumulating()[strategy]
    assert s["world_size"] == 2 and s["mesh"] == ({"dp_replicate": 2} if strategy == "ddp" else {"dp_shard": 2})
    assert s["activation_checkpointing"] == {"full": 2}  # both blocks, read from the modules
    assert_losses_match(s, single_refs()[0])


@pytest.mark.slow
def test_zero3_offload_reports_host_bytes():
    s = two_ranks_accumulating()["zero3_offload"]
    zero3 = two_ranks_accumulating()["zero3"]
    for off, z3 in zip(s["memory"], zero3["memory"]):
        held = off["params"] + off["grads"] + off["optimizer_state"]
        assert held > 0 and off["offloaded"] == held  # everything it holds is in host memory
        assert (off["params"], off["grads"]) == (z3["params"], z3["grads"])  # the same shards as zero3
    assert all(m["offloaded"] == 0 for m in zero3["memory"])


@pytest.mark.slow
def test_gradient_clipping_uses_the_global_norm(tmp_path):
    """zero2 clips inside its step (after the reduce-scatter), fsdp through DTensor gradients: both
    must clip by the norm of the *global* gradient, i.e. reproduce the single-device clipped run."""
    plain, clipped = single_refs()
    assert not np.allclose(plain["losses"], clipped["losses"], atol=1e-3)  # clipping is active
    runs = by_strategy(sweep(*CLIPPED))
    for s in runs.values():
        assert_losses_match(s, clipped)


@pytest.mark.slow
def test_bf16_mixed_runs():
    """Lightning's bf16-mixed (autocast; fp32 weights, grads and optimizer state) under zero2 and zero3."""
    runs = by_strategy(sweep(*BF16))
    ref = single_refs()[0]
    for name, s in runs.items():
        assert s["precision"] == "bf16-mixed", name
        losses = np.asarray(s["losses"])
        assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, name
        np.testing.assert_allclose(losses, ref["losses"], atol=2e-2, err_msg=name)  # bf16 compute, fp32 states
        assert all(m["params"] == 4 * s["n_params"] // (2 if name == "zero3" else 1) for m in s["memory"])


@pytest.mark.slow
def test_fsdp_options_mixed_precision_policy():
    """fsdp's own knobs: MixedPrecisionPolicy (bf16 gathers, fp32 reduction), units by class name,
    no reshard after forward, prefetch 2, activation checkpointing -- with fp32 shards."""
    (s,) = sweep(*FSDP_OPTIONS)
    np.testing.assert_allclose(s["losses"], single_refs()[0]["losses"], atol=2e-2)
    n = s["n_params"]
    assert all(m["params"] == 4 * n // 2 for m in s["memory"])  # shards stay fp32
    assert s["matmul_dtype"] == "bfloat16"  # what MFU is measured against


@pytest.mark.slow
def test_fsdp_mixed_precision_over_2d_dtensors():
    """param_dtype/reduce_dtype under fsdp_tp at 4 ranks (dp_shard=2 x tp=2): bf16 compute over fp32
    shards (the master copy), fp32 gradient reduction; losses near fp32 (atol 2e-2, as above)."""
    (s,) = sweep(*FSDP_TP_BF16)
    ref = single_refs()[0]
    np.testing.assert_allclose(s["losses"], ref["losses"], atol=2e-2)
    assert not np.allclose(s["losses"], ref["losses"], rtol=1e-6, atol=0)  # bf16 really computed
    assert s["matmul_dtype"] == "bfloat16"
    # the fp32 shards of the 4 ranks hold the model once, plus the norms and biases every tp rank
    # keeps whole (6.4% of gpt_tiny's bytes)
    held = sum(m["params"] for m in s["memory"]) / (4 * s["n_params"])
    assert 1 <= held < 1.1, held


def test_zero3_passes_fsdp_mixed_precision_on():
    from lightning_par.strategies import Zero3OffloadStrategy, Zero3Strategy

    for cls in (Zero3Strategy, Zero3OffloadStrategy):
        s = cls(param_dtype="bf16", reduce_dtype="fp32")
        assert (s.param_dtype, s.reduce_dtype, s.units, s.reshard_after_forward) == ("bf16", "fp32", "blocks", True)


@pytest.mark.slow
def test_impossible_settings_stop_with_one_line(tmp_path):
    proc = run_cli(["experiment=quick", "strategy=fsdp", "strategy.units=Blok"], tmp_path, timeout=90, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["error: unknown FSDP unit class 'Blok' for GPTModule; its block classes: GPT, Embedding, Block, "
                     "CausalSelfAttention, MLP, Head"], proc.stderr[-2000:]
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("args,pattern", [
    (["strategy=hsdp", "trainer.devices=3"], r"replicate=2 must be a positive divisor of the world size 3"),
    (["strategy=zero1", "+strategy.cpu_offload=true"], r"Zero1Strategy: unknown option\(s\) cpu_offload .*zero3_offload"),
    (["strategy=zero2", "+strategy.cpu_offload=true"], r"Zero2Strategy.__init__\(\) got an unexpected keyword argument 'cpu_offload'"),
    (["strategy=fsdp", "strategy.param_dtype=fp8"], r"unknown param_dtype 'fp8'"),
    (["strategy=tensor_parallel", "trainer.devices=2", "+strategy.param_dtype=bf16"], r"has no FSDP axis \(dp_shard=1\)"),
    (["strategy=fsdp", "strategy.prefetch=-1"], r"prefetch must be an integer >= 0"),
    (["strategy=zero3", "trainer.devices=3", "data.global_batch_size=8"], r"not divisible by data-parallel size 3"),
])
def test_impossible_settings_are_config_errors(tmp_path, args, pattern):
    """The same checks in-process (what run.py turns into ``error: ...`` and exit code 2)."""
    from lightning_par import ConfigError
    from lightning_par.run.train import build, validate

    cfg = composed("experiment=quick", *args, tmp=tmp_path)
    with pytest.raises(ConfigError, match=pattern):
        parts = build(cfg)
        validate(cfg, parts["strategy"], parts["model"], parts["datamodule"])
