"""Mixture of experts and ``strategy=expert_parallel``.

Loss parity (docs/architecture.md): fp32, same seed and data order, dropless routing (the MoE
default) -> the single-device run's per-step losses, for expert_parallel at 2 ranks (ep=2, 12
steps), ep=2 x FSDP dp_shard=2 at 4 ranks (12 steps) and ep=4 at 4 ranks (10 steps, continuing the
single run's step-2 checkpoint: that run is also the single -> expert_parallel resume test). The
runs use SGD (momentum 0.9, lr 0.1), which passes a gradient's scale straight into the update, so
a wrong expert-gradient scale (the 1/ep of ``Experts.grad_scale``) cannot hide as it would under
AdamW. Measured largest relative deviation: about 2e-7 (float32 rounding of reductions in another
order). Bound: rtol 1e-6. The global tokens per expert of every step must equal the single run's
exactly (the same routing).

An expert_parallel checkpoint (experts saved as ep shards under their full names) resumes under
single with the uninterrupted run's losses (rtol 1e-6).

The runs are shared through ``tests/sweeps.py``'s ``sweep`` (one cached multirun per argument list).
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from lightning_par import ConfigError
from lightning_par.callbacks.moe import MoEMonitor, summarize
from lightning_par.data import TextDataModule
from lightning_par.models import GPTModule, MoEModule
from lightning_par.models.moe import MoE, MoEConfig, MoEGPT, PRESETS
from lightning_par.strategies import ExpertParallelStrategy
from lightning_par.run.train import validate
from tests.sweeps import (
    MOE_SGD,
    MOE_TWO,
    assert_moe_figures,
    assert_moe_parity,
    by_strategy,
    moe_two,
    sweep,
    sweep_dir,
    together,
)

pytestmark = pytest.mark.timeout(600)

# this module's own sweeps (shared ones: sweeps.py), run one after another in one process when the first is
# needed (sweeps.together)
PIPELINE_AUX = (*MOE_SGD, "+model.aux_loss_coef=1.0", "+model.z_loss_coef=0.1", "strategy=single,pipeline",
                "trainer.devices=2")
LAYOUTS = {"ep2xtp2": ("strategy=tensor_parallel", "strategy.tp=2"), "ep2xpp2": ("strategy=pipeline", "strategy.pp=2")}
EP_WITH = {name: (*MOE_SGD, *layout, "strategy.ep=2", "trainer.devices=4") for name, layout in LAYOUTS.items()}
FSDP_TP_EP = (*MOE_SGD, "strategy=fsdp_tp", "strategy.ep=2", "trainer.devices=4", "trainer.gradient_clip_val=null,0.5")
SINGLE_CLIPPED = (*MOE_SGD, "strategy=single", "trainer.gradient_clip_val=0.5")
together(PIPELINE_AUX, *EP_WITH.values(), FSDP_TP_EP, SINGLE_CLIPPED)


# ------------------------------------------------------------------------------ fast, in-process
def test_presets_count_their_parameters():
    for name, fields in PRESETS.items():
        cfg = MoEConfig(**fields)
        with torch.device("meta"):
            model = MoEGPT(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.n_params, name
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        assert experts == cfg.n_expert_params, name


@pytest.mark.parametrize("gating,shared", [("softmax", False), ("sigmoid", True)])
def test_capacity_drops_and_dropless_does_not(gating, shared):
    torch.manual_seed(0)
    x = torch.randn(3, 16, 32)
    cfg = dict(n_layer=1, n_head=2, n_embd=32, n_experts=4, top_k=2, gating=gating, shared_expert=shared)
    dropless, capped = MoE(MoEConfig(**cfg)), MoE(MoEConfig(**cfg, capacity_factor=0.5))
    capped.load_state_dict(dropless.state_dict())
    for layer in (dropless, capped):
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.5)
        capped.load_state_dict(dropless.state_dict())
    y0, y1 = dropless.train()(x), capped.train()(x)
    s0, s1 = dropless.last_stats, capped.last_stats
    assert int(s0["dropped"]) == 0 and int(s0["tokens_per_expert"].sum()) == 3 * 16 * 2
    # capacity 0.5: each expert takes at most ceil(0.5 * 16 * 2 / 4) = 4 assignments per sequence
    assert int(s1["tokens_per_expert"].sum()) <= 3 * 4 * 4 and int(s1["dropped"]) > 0
    assert int(s1["tokens_per_expert"].sum() + s1["dropped"]) == 3 * 16 * 2
    assert not torch.allclose(y0, y1)
    assert dropless.aux_loss is not None and dropless.aux_loss.item() > 0
    y0.sum().backward()
    assert dropless.router.weight.grad.abs().sum() > 0 and dropless.experts.w1.grad.abs().sum() > 0


def test_training_loss_includes_the_aux_losses():
    module = MoEModule(preset="moe_tiny", seq_len=16, aux_loss_coef=1.0)
    module.configure_model()
    x = torch.randint(0, 256, (2, 16))
    module.log = lambda *a, **k: None
    loss = module.training_step((x, x), 0)
    ce = module.loss_fn(module(x), x)
    assert loss.item() > ce.item() + 0.5  # the balance loss is >= 1 x coefficient when weighted by its own scores


def test_summary_figures():
    # 2 steps, 1 layer, 2 experts + dropped column
    steps = torch.tensor([[[6.0, 2.0, 0.0]], [[4.0, 3.0, 1.0]]])
    s = summarize(steps, a2a_bytes=1000.0, n_steps=2)
    assert s["tokens_per_expert"] == [[[6, 2]], [[4, 3]]]
    assert s["load_balance_max_over_mean"] == [1.5, round(4 / 3.5, 4)]
    assert s["dropped_fraction"] == pytest.approx(1 / 16)
    assert s["all_to_all_bytes_per_step"] == 500.0


def test_monitor_does_nothing_for_a_dense_model():
    monitor, module = MoEMonitor(), GPTModule(preset="gpt_tiny")
    module.configure_model()
    # a trainer without a strategy: any collective or read of the model's layers would fail
    trainer = SimpleNamespace(global_step=0, world_size=2)
    monitor.on_train_start(trainer, module)
    trainer.global_step = 1
    monitor.on_train_batch_end(trainer, module, None, None, 0)
    monitor.on_train_end(trainer, module)
    assert monitor.summary() == {} and monitor._pending == [] and monitor._current is None


def _cfg(devices: int):
    return OmegaConf.create({"trainer": {"accelerator": "cpu", "devices": devices, "num_nodes": 1,
                                         "precision": "32-true"}, "data": {"global_batch_size": 8}})


@pytest.mark.parametrize("model,devices,ep,pattern", [
    ("moe", 3, None, r"n_experts=4 of MoEModule is not divisible by ep=3"),
    ("moe", 4, 3, r"ep=3 does not divide the world size 4"),
    ("gpt", 2, None, r"GPTModule has no experts to spread over ranks"),
])
def test_bad_sizes_are_config_errors(model, devices, ep, pattern):
    module = MoEModule(preset="moe_tiny") if model == "moe" else GPTModule(preset="gpt_tiny")
    with pytest.raises(ConfigError, match=pattern):
        validate(_cfg(devices), ExpertParallelStrategy(ep=ep), module, TextDataModule())


# --------------------------------------------------------------------- end to end (shared runs)
def _checkpoint(strategy: str, step: int) -> Path:
    job = MOE_TWO[3].split("=")[1].split(",").index(strategy)
    path = sweep_dir(*MOE_TWO) / str(job) / "checkpoints" / f"step{step:06d}.ckpt"
    assert path.is_dir(), path
    return path


def _params_per_rank(ep: int) -> int:
    """Parameter bytes (fp32) a rank holds with 1/ep of the experts and everything else whole."""
    cfg = MoEConfig(**PRESETS["moe_tiny"])
    return 4 * (cfg.n_params - cfg.n_expert_params + cfg.n_expert_params // ep)


@pytest.mark.slow
def test_expert_parallel_two_ranks_matches_single():
    runs = moe_two()
    s, ref = runs["expert_parallel"], runs["single"]
    assert s["world_size"] == 2 and ref["world_size"] == 1
    assert_moe_parity(s, ref)
    assert_moe_figures(s, ref, ep=2)
    assert [m["params"] for m in s["memory"]] == [_params_per_rank(2)] * 2
    assert [m["params"] for m in ref["memory"]] == [_params_per_rank(1)]


@pytest.mark.slow
def test_ep_times_fsdp_four_ranks_matches_single():
    (s,) = sweep(*MOE_SGD, "strategy=expert_parallel", "trainer.devices=4", "strategy.ep=2",
                 "strategy.data_parallel=fsdp")
    ref = moe_two()["single"]
    assert s["world_size"] == 4 and s["mesh"] == {"dp_shard": 2, "ep": 2}
    assert_moe_parity(s, ref)
    assert_moe_figures(s, ref, ep=2)
    held = [m["params"] for m in s["memory"]]  # 1/4 of everything, plus FSDP's padding
    assert 4 * ref["n_params"] <= sum(held) <= 1.01 * 4 * ref["n_params"], held


@pytest.mark.slow
def test_single_checkpoint_resumes_under_ep_four_ranks():
    """Single's step-2 checkpoint, continued for 10 steps with the experts over 4 ranks (ep=4)."""
    (s,) = sweep(*MOE_SGD, "strategy=expert_parallel", "trainer.devices=4",
                 f"ckpt_path={_checkpoint('single', 2)}")
    ref = moe_two()["single"]
    assert s["world_size"] == 4 and s["mesh"] == {"ep": 4}
    assert_moe_parity(s, ref, first=2)  # steps 3..12 computed under ep=4 (steps 1-2 come from the checkpoint)
    assert_moe_figures(s, ref, ep=4, first=2)
    assert [m["params"] for m in s["memory"]] == [_params_per_rank(4)] * 4


@pytest.mark.slow
def test_expert_parallel_checkpoint_resumes_under_single():
    ckpt = _checkpoint("expert_parallel", 6)
    (s,) = sweep(*MOE_SGD, "strategy=single", f"ckpt_path={ckpt}")
    assert s["world_size"] == 1
    assert_moe_parity(s, moe_two()["single"], first=6)  # steps 7..12 after the resume


@pytest.mark.slow
def test_pipeline_keeps_the_aux_losses_and_matches_single():
    """A pipeline's stages return only activations, so each MoE layer feeds its auxiliary loss into
    backward itself (``AuxLossSource``, scaled like a micro-batch's loss) and the pipeline adds the
    stages' aux values to the loss it reports. With aux_loss_coef=1 and z_loss_coef=0.1 (the aux
    terms are about a third of the loss) the 2-stage pipeline (2 micro-batches) matches the single
    run at rtol 1e-6 (measured max 1.9e-7), and so do the global tokens per expert -- the layers of
    both stages, every micro-batch, without the shape-inference forward of the first step. Measured
    when this was written: without the aux gradient the pipeline's cross-entropy drifted from the
    single run's by 0.3% at step 5 and 10% at step 10."""
    runs = by_strategy(sweep(*PIPELINE_AUX))
    s, ref = runs["pipeline"], runs["single"]
    assert s["mesh"] == {"pp": 2}
    assert_moe_parity(s, ref)
    assert s["moe"]["tokens_per_expert"] == ref["moe"]["tokens_per_expert"]
    assert s["moe"]["n_layers"] == ref["moe"]["n_layers"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_composes_with_tensor_and_pipeline_parallelism(layout):
    """ep=2 taken from the data axis beside tp=2 (the MoE layers run whole on both tp ranks; attention
    and dense MLPs split) or beside pp=2 (each stage's experts over its own ep group), 4 ranks, against
    the single run: rtol 1e-6 (measured max 3.1e-7 and 2.5e-7), the same global tokens per expert."""
    (s,) = sweep(*EP_WITH[layout])
    ref = moe_two()["single"]
    axis = LAYOUTS[layout][1].split(".")[1].split("=")[0]
    assert s["world_size"] == 4 and s["mesh"] == {axis: 2, "ep": 2}
    assert_moe_parity(s, ref)
    assert_moe_figures(s, ref, ep=2)


@pytest.mark.slow
def test_ep_times_fsdp_tp_clips_by_the_global_norm():
    """fsdp_tp with ep=2 at 4 ranks: tp=2 x ep=2 and no dp_shard left, so FSDP shards the non-expert
    parameters over ep (2-D DTensors on (ep, tp)) while the experts stay ep shards outside FSDP. Unclipped
    and clipped at 0.5 (the gradient's norm is larger: clipping moves the single run's losses by up to
    20%), against the single run with the same clipping: rtol 1e-6 (measured max 3.1e-7 and 1.7e-7). The
    clipped run checks that the global norm combines every kind of gradient (FSDP x TP shards, experts on
    ep) over its own mesh."""
    plain, clipped = sweep(*FSDP_TP_EP)
    (ref_clipped,) = sweep(*SINGLE_CLIPPED)
    ref = moe_two()["single"]
    assert np.max(np.abs(np.subtract(ref["losses"], ref_clipped["losses"]))) > 1e-3  # the clipping is active
    for s, r in ((plain, ref), (clipped, ref_clipped)):
        assert s["world_size"] == 4 and s["mesh"] == {"ep": 2, "tp": 2}
        assert_moe_parity(s, r)
        assert_moe_figures(s, r, ep=2)


@pytest.mark.parametrize("kwargs,devices,model,pattern", [
    (dict(tp=2, ep=3), 4, "moe", r"ep=3 does not divide the data-parallel degree 2"),
    (dict(tp=2, ep=3), 6, "moe", r"n_experts=4 of MoEModule is not divisible by ep=3"),
    (dict(tp=2, ep=2, sequence_parallel=True), 4, "moe", r"sequence_parallel with an MoE model \(MoEModule\) is not"),
    (dict(tp=2, sequence_parallel=True), 4, "moe", r"sequence_parallel with an MoE model \(MoEModule\) is not"),
    (dict(tp=1, ep=2), 4, "gpt", r"GPTModule has no experts"),
    (dict(tp=1, ep=4, data_parallel="fsdp", param_dtype="bf16"), 4, "moe", r"need a dp_shard axis beside ep=4"),
])
def test_mesh_strategies_refuse_bad_expert_parallel_sizes(kwargs, devices, model, pattern):
    from lightning_par.strategies.composite import MeshParallelStrategy

    module = MoEModule(preset="moe_tiny") if model == "moe" else GPTModule(preset="gpt_tiny")
    with pytest.raises(ConfigError, match=pattern):
        validate(_cfg(devices), MeshParallelStrategy(**kwargs), module, TextDataModule())
