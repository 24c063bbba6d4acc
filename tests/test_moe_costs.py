"""The cost model on mixture-of-experts models (lightning_par/costs, costs/estimate.py, costs/advisor.py).

Memory. One real training step (after a warm-up step that creates the optimizer state) of the MoE
decoder (models/moe.py: routed experts, router, balance and z-losses, optional shared expert) is
tracked by torch's ``MemTracker``; its peak must be within 15% of ``estimate(...).peak`` -- the same
bound as the dense GPT's (tests/test_activation_memory.py). The shapes make the MoE terms matter:
top-1 and top-2 routing, many small experts, a shared expert with sigmoid gating, MoE every other
block, a capacity factor, fp32 and bf16 autocast.

States. Expert parallelism divides the routed experts by ep and nothing else (replicate), or,
with FSDP, spreads the non-expert states over the world and the experts' over dp = world / ep:
checked against the parameter counts of the model built on the meta device.
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.costs.shape import Shape
from lightning_par.costs.estimate import estimate, model_shape
from lightning_par.models.moe import PRESETS, MoEConfig, MoEGPT
from tests.helpers import memtracker_step_peak
from tests.sweeps import together

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 0.15

# MoEConfig fields, (batch, seq_len), precision
CASES = {
    "top2-fp32": (dict(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_experts=4, top_k=2), (4, 64), "32-true"),
    "top1-many-experts-fp32": (dict(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_experts=16, top_k=1,
                                    expert_hidden=128), (4, 64), "32-true"),
    "shared-sigmoid-every-2nd-fp32": (dict(n_layer=4, n_head=2, n_embd=64, vocab_size=512, n_experts=8, top_k=2,
                                           moe_every=2, shared_expert=True, gating="sigmoid"), (4, 64), "32-true"),
    "top4-long-seq-fp32": (dict(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_experts=8, top_k=4,
                                expert_hidden=64), (2, 256), "32-true"),
    "capacity-bf16": (dict(n_layer=2, n_head=2, n_embd=64, vocab_size=2048, n_experts=4, top_k=2,
                           capacity_factor=1.25), (4, 64), "bf16-mixed"),
}


def measured_peak(cfg: MoEConfig, batch: int, seq: int, precision: str) -> int:
    torch.manual_seed(0)
    return memtracker_step_peak(MoEGPT(cfg).train(), cfg.vocab_size, batch, seq, precision)


@pytest.mark.parametrize("case", list(CASES))
def test_moe_peak_within_15_percent_of_memtracker(case):
    fields, (batch, seq), precision = CASES[case]
    cfg = MoEConfig(block_size=seq, **fields)
    shape = Shape.of(cfg, seq)
    est = estimate(shape, devices=1, strategy="single", precision=precision, optimizer="adamw",
                   micro_batch_size=batch, device="cpu")
    got = measured_peak(cfg, batch, seq, precision)
    assert abs(est.peak - got) <= TOLERANCE * got, (
        f"{case}: estimated peak {est.peak:,} B ({est.moment}), MemTracker {got:,} B, ratio {est.peak / got:.3f}")


def test_the_moe_terms_are_what_moves_the_estimate():
    """Without its MoE fields the same shape (a dense GPT) is estimated far off MemTracker's MoE peak:
    the test above cannot pass on the dense model alone."""
    fields, (batch, seq), precision = CASES["top4-long-seq-fp32"]
    cfg = MoEConfig(block_size=seq, **fields)
    moe = Shape.of(cfg, seq)
    dense = Shape(moe.n_layer, moe.n_embd, moe.n_head, moe.vocab_size, seq)
    kw = dict(devices=1, strategy="single", precision=precision, optimizer="adamw", micro_batch_size=batch,
              device="cpu")
    got = measured_peak(cfg, batch, seq, precision)
    assert abs(estimate(dense, **kw).peak - got) > TOLERANCE * got


def _states(shape: Shape, devices: int, **layout) -> int:
    est = estimate(shape, devices=devices, strategy="expert_parallel", precision="32-true", optimizer="adamw",
                   micro_batch_size=1, **layout)
    return est.params


@pytest.mark.parametrize("preset", ["moe_tiny", "moe_8x_top2", "moe_64x_top8"])
def test_expert_parallel_divides_the_experts_by_ep(preset):
    cfg = MoEConfig(**PRESETS[preset])
    with torch.device("meta"):
        net = MoEGPT(cfg)
    experts = sum(p.numel() for n, p in net.named_parameters() if ".experts." in n)
    rest = sum(p.numel() for p in net.parameters()) - experts
    _, shape = model_shape(preset)
    n = 8 if cfg.n_experts % 8 == 0 else 4
    for ep in (2, n):
        # replicate: every rank holds all non-expert parameters and 1/ep of the experts (fp32: 4 bytes)
        assert _states(shape, n, ep=ep, data_parallel="replicate") == pytest.approx(4 * (rest + experts / ep), rel=1e-6)
        if ep == n:  # fsdp with ep = world: the non-expert parameters over the world, the experts' 1/ep unsharded
            assert _states(shape, n, ep=ep, data_parallel="fsdp") == pytest.approx(4 * (rest / n + experts / n),
                                                                                   rel=1e-4)
            continue
        # fsdp: non-expert over the world, the experts' 1/ep over dp = n / ep: everything over n
        assert _states(shape, n, ep=ep, data_parallel="fsdp") == pytest.approx(4 * (rest / n + experts / n), rel=1e-4)
    ddp = estimate(shape, devices=n, strategy="ddp", precision="32-true", optimizer="adamw", micro_batch_size=1)
    assert ddp.params == pytest.approx(4 * (rest + experts), rel=1e-6)  # data parallelism replicates the experts


def test_estimate_mode_prices_expert_parallel(tmp_path):
    import json

    from tests.helpers import run_cli

    run_cli(["mode=estimate", "model=moe_tiny", "strategy=expert_parallel", "strategy.data_parallel=fsdp",
             "strategy.ep=2", "trainer.devices=4"], tmp_path, timeout=120)
    record = json.loads((tmp_path / "estimate.json").read_text())
    rows = {r["strategy"]: r for r in record["strategies"]}
    assert record["mesh"] == {"dp_shard": 2, "ep": 2}
    ep = rows["expert_parallel"]
    assert ep["peak"] > 0 and ep["mesh"] == {"dp_shard": 2, "ep": 2}
    assert ep["params"] == pytest.approx(rows["fsdp"]["params"], rel=1e-3)  # both spread every state over 4 ranks
    assert ep["params"] < rows["ddp"]["params"] / 3


# ------------------------------------------------ against real runs (test_moe.py's shared multiruns)
def _comm_and_states(s: dict, ep: int, data_parallel: str, accumulate: int = 1) -> None:
    from lightning_par.costs.comm import CommShape, step_comm_bytes

    cfg = MoEConfig(**PRESETS["moe_tiny"])
    world = s["world_size"]
    seq = round(s["tokens_per_s"] / s["samples_per_s"])
    micro = s["global_batch_size"] // world // accumulate
    shape = CommShape(shape=Shape.of_gpt(cfg, seq), micro_batch=micro)
    model = step_comm_bytes("expert_parallel", n_params=cfg.n_params, mesh=s["mesh"], shape=shape,
                            expert_params=cfg.n_expert_params, data_parallel=data_parallel, accumulate=accumulate)
    ranks = s["comm"]["per_rank"]
    # dropless routing: each rank sends all its tokens x top_k rows, but receives what the router sends it,
    # so one rank's all-to-all payload moves with the routing while the mean over the ep group is fixed
    a2a = [r["bytes"]["all_to_all"]["ep"] for r in ranks]
    assert sum(a2a) / len(a2a) == model["all_to_all"]["ep"], (a2a, model)
    for r in ranks:  # the gradient collectives depend on no routing: every rank equals the model
        assert {k: v for k, v in r["bytes"].items() if k != "all_to_all"} == \
            {k: v for k, v in model.items() if k != "all_to_all"}, (r["bytes"], model)
    _, mshape = model_shape("moe_tiny", seq)
    est = estimate(mshape, devices=world, strategy="expert_parallel", ep=ep, data_parallel=data_parallel,
                   precision="32-true", optimizer="sgd", micro_batch_size=micro, device="cpu")
    held = [m["params"] for m in s["memory"]]
    assert all(h == pytest.approx(est.params, rel=0.01) for h in held), (held, est.params)  # FSDP pads shards


# this module's own sweeps (moe_two and ep x FSDP at 4 ranks are test_moe's too), run one after another in one
# process when the first is needed (sweeps.together)
EP_FSDP_WHOLE = ("model=moe_tiny", "model.optimizer=sgd", "model.lr=0.1", "strategy=expert_parallel", "trainer.devices=2",
                 "strategy.data_parallel=fsdp")
EP_ACCUMULATING = ("model=moe_tiny", "model.optimizer=sgd", "model.lr=0.1", "strategy=expert_parallel",
                   "trainer.devices=2", "trainer.accumulate_grad_batches=2", "trainer.max_steps=3")
together(EP_FSDP_WHOLE, EP_ACCUMULATING)


@pytest.mark.slow
def test_expert_parallel_comm_and_states_match_the_models():
    """ep=2 at 2 ranks (replicate), ep=2 x FSDP at 4 ranks, and FSDP with ep = the whole world at 2
    ranks (the non-expert parameters FSDP-sharded over ep, the experts outside FSDP): the all-to-all,
    all-reduce, all-gather and reduce-scatter bytes CommMonitor counted equal comm_model's; each
    rank's parameter bytes equal the estimator's within FSDP's padding (1%). The last run also
    matches the single run's losses at rtol 1e-6 (SGD, test_moe.py's bound)."""
    from tests.sweeps import MOE_SGD, assert_moe_figures, assert_moe_parity, moe_two, sweep

    assert EP_FSDP_WHOLE[:3] == EP_ACCUMULATING[:3] == MOE_SGD
    _comm_and_states(moe_two()["expert_parallel"], 2, "replicate")
    (four,) = sweep(*MOE_SGD, "strategy=expert_parallel", "trainer.devices=4", "strategy.ep=2",
                    "strategy.data_parallel=fsdp")
    _comm_and_states(four, 2, "fsdp")
    (whole,) = sweep(*EP_FSDP_WHOLE)
    assert whole["mesh"] == {"ep": 2}
    _comm_and_states(whole, 2, "fsdp")
    assert_moe_parity(whole, moe_two()["single"])
    assert_moe_figures(whole, moe_two()["single"], ep=2)
    # 2 accumulated micro-batches: the all-to-alls and the replicated gradients' average, every micro-batch
    (accumulating,) = sweep(*EP_ACCUMULATING)
    _comm_and_states(accumulating, 2, "replicate", accumulate=2)


def test_ep_beside_other_strategies_is_refused_not_mispriced():
    """The mesh strategies run ep too, but the estimator prices only strategy=expert_parallel's layouts:
    anything else with ep > 1 is one clear error rather than a figure that replicates the experts."""
    _, shape = model_shape("moe_tiny")
    with pytest.raises(ValueError, match="expert parallelism with strategy=expert_parallel only"):
        estimate(shape, devices=4, strategy="tensor_parallel", tp=2, ep=2, micro_batch_size=1)
    # the MoE layers run whole on every tp rank: not priced, rather than divided by tp
    for strategy in ("tensor_parallel", "fsdp_tp", "3d"):
        with pytest.raises(ValueError, match="does not price tensor parallelism of an MoE model"):
            estimate(shape, devices=8, strategy=strategy, tp=2, micro_batch_size=1)
