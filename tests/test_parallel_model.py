"""Model parallelism (layer 1): tensor parallelism on DTensor and pipeline parallelism on
torch.distributed.pipelining, checked against a single-process reference on gloo ranks.

Each multi-process test runs every variant inside one spawn (the ranks' start-up dominates) and
compares losses, gradients and parameters with an unsharded copy of the same model computed in
the same process.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par.callbacks.bubble import BubbleMeter
from lightning_par.models.gpt import GPT, GPTConfig
from lightning_par.parallel.pipeline.schedule import (
    Pipeline,
    PipelineStageModule,
    balance_layers,
    build_schedule,
    build_stage_modules,
    layer_costs_by_params,
    stage_indices_for_rank,
    theoretical_bubble,
    validate_pipeline,
)
from lightning_par.parallel.tensor.tensor_parallel import (
    apply_tensor_parallel,
    check_tp_divisible,
    loss_parallel_context,
    match_modules,
)
from tests.dist import run_distributed

pytestmark = pytest.mark.slow  # multi-process (gloo) runs

TP_CFG = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64)
PP_CFG = dict(n_layer=6, n_head=4, n_embd=32, block_size=16, vocab_size=64)  # 8 layers: 4 ranks x 2 chunks


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _batches(n: int, b: int = 8, t: int = 16, vocab: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g))
            for _ in range(n)]


# ------------------------------------------------------------------------------------------------
# tensor parallel


def _tp_worker(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    results = {}
    for sp, lp in [(False, False), (False, True), (True, False), (True, True)]:
        torch.manual_seed(0)
        ref = GPT(GPTConfig(**TP_CFG))
        model = copy.deepcopy(ref)
        plan = model.parallel_plan()
        apply_tensor_parallel(model, tp_mesh=mesh["tp"], plan=plan.tp_plan, sequence_parallel=sp,
                              loss_parallel=lp, divisible=plan.tp_divisible)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        losses, ref_losses = [], []
        for step, (x, y) in enumerate(_batches(3)):
            with loss_parallel_context(lp):
                loss = _lm_loss(model(x), y)
                loss.backward()
            ref_loss = _lm_loss(ref(x), y)
            ref_loss.backward()
            if step == 0:
                for (name, p), (ref_name, q) in zip(model.named_parameters(), ref.named_parameters()):
                    assert name == ref_name and isinstance(p, DTensor), name  # every parameter a DTensor
                    torch.testing.assert_close(_full(p.grad), q.grad, msg=f"grad of {name} (sp={sp}, lp={lp})")
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # refuses Tensor/DTensor mixes
                torch.testing.assert_close(_full(norm), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            losses.append(_full(loss).item())
            ref_losses.append(ref_loss.item())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if name.endswith("attn.wk.bias"):  # softmax ignores it: its gradient is noise that Adam amplifies
                continue
            # gradients were compared exactly at step 0; after 3 Adam steps (lr 1e-2) an entry whose
            # gradient is near Adam's eps (a rarely seen token's embedding row) turns rounding noise
            # into an update difference of up to ~2e-4, so parameters are compared at 1e-3 -- a
            # wrong reduction moves whole tensors by ~lr = 1e-2
            torch.testing.assert_close(_full(p.detach()), q.detach(), rtol=1e-4, atol=1e-3,
                                       msg=f"{name} after 3 steps (sp={sp}, lp={lp})")
        results[(sp, lp)] = (losses, ref_losses)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_matches_single_process(world_size: int) -> None:
    results = run_distributed(_tp_worker, world_size, timeout=240)
    for per_rank in results:
        for (sp, lp), (losses, ref_losses) in per_rank.items():
            assert losses == pytest.approx(ref_losses, rel=1e-5), (sp, lp)
    assert results[0] == results[-1]


def _tp_single_rank(fn) -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        fn(init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))["tp"])
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_plan_errors() -> None:
    model = GPT(GPTConfig(**TP_CFG))
    with pytest.raises(ValueError, match="needs a plan"):
        apply_tensor_parallel(model, tp_mesh=None, plan={})  # type: ignore[arg-type]

    def check(mesh) -> None:
        with pytest.raises(ValueError, match="unknown tensor-parallel style 'diagonal'"):
            apply_tensor_parallel(model, tp_mesh=mesh, plan={"head.lm_head": "diagonal"})
        with pytest.raises(ValueError, match="'blocks.\\*.nope' matches no module"):
            apply_tensor_parallel(model, tp_mesh=mesh, plan={"blocks.*.nope": "colwise"})
        applied = apply_tensor_parallel(model, tp_mesh=mesh, plan=model.parallel_plan().tp_plan)
        assert applied["blocks.1.attn.wq"] == "colwise"
        assert applied["blocks.0.ln_1"] == "replicate"  # no SP: replicated, not sharded
        assert applied["embed.pos"] == "position"  # named by the plan; without SP it is replicated too
        assert _lm_loss(model(torch.randint(0, 64, (2, 16))), torch.zeros(2, 16, dtype=torch.long)).isfinite()

    _tp_single_rank(check)


def test_check_tp_divisible_and_matching() -> None:
    check_tp_divisible(4, {"n_head": 8, "vocab_size": 64})
    with pytest.raises(ValueError, match=r"^tensor-parallel degree tp=3 does not divide n_head=4"):
        check_tp_divisible(3, {"n_head": 4, "vocab_size": 63})
    model = GPT(GPTConfig(**TP_CFG))
    assert match_modules(model, "blocks.*.attn.wq") == ["blocks.0.attn.wq", "blocks.1.attn.wq"]
    assert match_modules(model, "blocks.*.wq") == []  # '*' is exactly one path component


# ------------------------------------------------------------------------------------------------
# pipeline parallel


def _pipeline(model: nn.Module, schedule: str, v: int) -> Pipeline:
    """This rank's stages of ``model`` and their schedule, built as the pipeline strategy builds them
    (``strategies/pipeline_plan.plan_pipeline`` and ``_build_schedule``): layers balanced by parameter count, one
    micro-batch per rank."""
    pp, rank = dist.get_world_size(), dist.get_rank()
    layers = model.parallel_plan().layers
    n_stages = validate_pipeline(schedule, pp_size=pp, n_microbatches=pp, virtual_stages=v, n_layers=len(layers))
    bounds = balance_layers(layer_costs_by_params(model, layers), n_stages)
    indices = stage_indices_for_rank(schedule, rank, pp, v)
    stages = build_stage_modules(model, layers=layers, boundaries=bounds, stage_indices=indices)
    return build_schedule(stages, schedule=schedule, n_microbatches=pp, loss_fn=_lm_loss, virtual_stages=v,
                          stage_indices=indices)


def _pp_worker(rank: int, world_size: int, variants: list[tuple[str, int]]) -> dict:
    results = {}
    for schedule, v in variants:
        torch.manual_seed(0)
        ref = GPT(GPTConfig(**PP_CFG))
        model = copy.deepcopy(ref)
        pipe = _pipeline(model, schedule, v)
        opt = torch.optim.SGD(list(pipe.parameters()), lr=0.5)  # SGD: gradient scale errors show up
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        ref_params = dict(ref.named_parameters())
        losses, ref_losses = [], []
        for step, (x, y) in enumerate(_batches(3)):
            loss = pipe.step(x, y)
            ref_loss = _lm_loss(ref(x), y)
            ref_loss.backward()
            if step == 0:
                for module in pipe.modules:
                    for name, p in module.named_parameters():  # stage FQNs are the model's FQNs
                        torch.testing.assert_close(p.grad, ref_params[name].grad, msg=f"{schedule}: grad {name}")
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
            if step == 1:  # forward-only pass between training steps
                x, y = _batches(4)[3]
                eval_loss = pipe.eval_step(x, y).item()
                with torch.no_grad():
                    ref_eval = _lm_loss(ref(x), y).item()
        meter = BubbleMeter()  # what BubbleMonitor measures: the last schedule call (step 2's)
        stats = dict(bubble=meter.add(pipe.timer, step=2), busy_s=meter.busy[-1], per_stage=meter.busy_by_stage,
                     theory=theoretical_bubble(schedule, world_size, world_size, len(pipe.stages)))
        results[schedule] = dict(losses=losses, ref_losses=ref_losses, eval=(eval_loss, ref_eval),
                                 stages=[m.stage_index for m in pipe.modules], bubble=stats)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_pipeline_matches_single_process(world_size: int) -> None:
    variants = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]
    if world_size == 2:
        variants += [("zb", 2), ("zbv", 2)]  # zero-bubble schedules: F / I / W split backward
    results = run_distributed(_pp_worker, world_size, variants, timeout=300)
    for rank, per_rank in enumerate(results):
        for schedule, r in per_rank.items():
            assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5), schedule
            assert r["eval"][0] == pytest.approx(r["eval"][1], rel=1e-5), schedule
            assert r["stages"] == stage_indices_for_rank(schedule, rank, world_size, 2 if schedule in (
                "interleaved_1f1b", "zb", "zbv") else 1)
            b = r["bubble"]
            assert 0.0 <= b["bubble"] < 1.0 and b["busy_s"] > 0 and set(b["per_stage"]) == set(r["stages"])
    assert results[0]["1f1b"]["bubble"]["theory"] == pytest.approx((world_size - 1) / (2 * world_size - 1))


def test_balance_layers() -> None:
    assert balance_layers([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balance_layers([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert balance_layers([1, 1, 1, 1, 1, 1], 4) == [0, 2, 4, 5, 6]  # ties: stages packed from the front
    assert balance_layers([1, 1, 1, 10], 2) == [0, 3, 4]
    assert balance_layers([3, 3, 3], 3) == [0, 1, 2, 3]
    assert balance_layers([2, 2, 2, 2, 2], 1) == [0, 5]
    costs = [4, 1, 1, 1, 4, 1, 1, 4, 2, 3]
    for k in range(1, len(costs) + 1):  # optimal against brute force over all cuts
        b = balance_layers(costs, k)
        assert len(b) == k + 1 and all(i < j for i, j in zip(b, b[1:]))
        best = min(max(sum(costs[i:j]) for i, j in zip((0, *cut), (*cut, len(costs))))
                   for cut in itertools.combinations(range(1, len(costs)), k - 1))
        assert max(sum(costs[i:j]) for i, j in zip(b, b[1:])) == best
    assert balance_layers([0, 0, 0], 3) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 pipeline stages"):
        balance_layers([1, 1], 3)


def test_stage_modules_keep_fqns_and_compose() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**PP_CFG))
    layers = model.parallel_plan().layers
    costs = layer_costs_by_params(model, layers)
    assert sum(costs) == sum(p.numel() for p in model.parameters())
    bounds = balance_layers(costs, 3)
    stages = build_stage_modules(model, layers=layers, boundaries=bounds, stage_indices=[0, 1, 2])
    names = [n for s in stages for n in s.fqns]
    assert names == [n for n, _ in model.named_parameters()]
    assert list(stages[0].state_dict())[0] == "embed.tok.weight"
    x = torch.randint(0, 64, (2, 16))
    h = x
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, model(x))

    with pytest.raises(ValueError, match="belongs to no pipeline layer"):
        build_stage_modules(model, layers=layers[:-1], boundaries=[0, len(layers) - 1], stage_indices=[0])
    with pytest.raises(ValueError, match="overlap"):
        build_stage_modules(model, layers=["blocks", "blocks.0"], boundaries=[0, 2], stage_indices=[0])
    assert isinstance(stages[0], PipelineStageModule)


@pytest.mark.parametrize("schedule, kw, match", [
    ("1f1b", dict(pp_size=4, n_microbatches=2), "needs n_microbatches >= pipeline stages"),
    ("interleaved_1f1b", dict(pp_size=4, n_microbatches=3, virtual_stages=2), "needs n_microbatches"),
    ("interleaved_1f1b", dict(pp_size=2, n_microbatches=5, virtual_stages=2), "multiple of n_microbatches // pp"),
    ("gpipe", dict(pp_size=4, n_microbatches=8, n_layers=3), "cannot cut 3 layers into 4 pipeline stages"),
    ("interleaved_1f1b", dict(pp_size=4, n_microbatches=4, virtual_stages=2, n_layers=6), "into 8 pipeline"),
    ("gpipe", dict(pp_size=2, n_microbatches=2, virtual_stages=2), "one stage per rank"),
    ("zbv", dict(pp_size=2, n_microbatches=2, virtual_stages=3), "exactly 2 stages per rank"),
    ("dualpipe", dict(pp_size=2, n_microbatches=2), "unknown pipeline schedule"),
])
def test_validate_pipeline_errors(schedule: str, kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_pipeline(schedule, **kw)


def test_validate_pipeline_ok_and_theory() -> None:
    assert validate_pipeline("gpipe", pp_size=4, n_microbatches=1, n_layers=4) == 4  # naive model parallel
    assert validate_pipeline("interleaved_1f1b", pp_size=2, n_microbatches=2, virtual_stages=2) == 4
    assert theoretical_bubble("gpipe", 4, 4) == pytest.approx(3 / 7)
    assert theoretical_bubble("1f1b", 1, 8) == 0.0
    assert theoretical_bubble("interleaved_1f1b", 4, 4, v=2) == pytest.approx(3 / 11)
    assert theoretical_bubble("zb", 4, 4, v=2) == pytest.approx(3 / 27)
    assert theoretical_bubble("zbv", 4, 8, v=2) == 0.0
    assert stage_indices_for_rank("interleaved_1f1b", 1, 4, 2) == [1, 5]
    assert stage_indices_for_rank("zbv", 1, 4, 2) == [1, 6]
    assert stage_indices_for_rank("1f1b", 3, 4) == [3]


def test_stage_modules_need_full_coverage() -> None:
    # a model whose layers forget a parameter-holding module must not lose it quietly
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.scale = nn.Parameter(torch.ones(()))

    with pytest.raises(ValueError, match="'scale' belongs to no pipeline layer"):
        build_stage_modules(Two(), layers=["a"], boundaries=[0, 1], stage_indices=[0])
