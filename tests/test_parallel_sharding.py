"""ZeRO-1, ZeRO-2 and FSDP (layer 1) reproduce single-process training on gloo ranks.

Every rank sees its slice of the global batch; the reference is a single-process run on the full
batch computed inside each rank (same seed), so parameters must agree after a few steps.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_par.callbacks.memory import measure_model_states
from lightning_par.models.gpt import GPT, GPTConfig
from lightning_par.parallel.sharding.fsdp import apply_fsdp, resolve_units
from lightning_par.parallel.sharding.zero import Zero2Optimizer, make_zero1_optimizer
from lightning_par.strategies.zero import Zero2Strategy
from tests.dist import run_distributed

pytestmark = pytest.mark.slow  # multi-process (gloo) runs

STEPS, BATCH = 3, 8


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 15), nn.Tanh(), nn.Linear(15, 3))  # 183 params: padding at N=2, 4


def _groups(model: nn.Module) -> list[dict]:
    """Two groups with different weight decay: weights decay, biases do not."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 3, generator=g)


def _local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int = 0, world: int = 1) -> None:
    for step in steps:
        x, y = _batch(step)
        F.mse_loss(model(_local(x, rank, world)), _local(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _zero2_state_bytes(model: nn.Module, opt: Zero2Optimizer) -> dict[str, int]:
    """What the memory callback counts for strategy=zero2 holding ``opt`` (its ``model_state_tensors``)."""
    strategy = SimpleNamespace(optimizers=[opt], lightning_module=model)
    strategy.model_state_tensors = lambda: Zero2Strategy.model_state_tensors(strategy)
    states = measure_model_states(strategy, model, [opt])
    return {k: states[k] for k in ("params", "grads", "optimizer_state")}


def _zero_worker(rank: int, world: int) -> dict:
    out: dict = {}
    ref = _tiny()
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    _train(ref, ref_opt, range(STEPS))

    # ZeRO-2: local, un-reduced gradients go straight into step()
    model = _tiny()
    opt = Zero2Optimizer(torch.optim.AdamW(_groups(model), lr=1e-2), model)
    for step in range(STEPS):
        x, y = _batch(step)
        F.mse_loss(model(_local(x, rank, world)), _local(y, rank, world)).backward()
        opt.step()
        out.setdefault("grads_after_step", []).append([p.grad for p in model.parameters()])
        out.setdefault("state_bytes", _zero2_state_bytes(model, opt))
        opt.zero_grad()
    out["zero2_diff"] = _max_diff(model, ref)
    out["shard"] = opt.grad_shard.numel()
    out["state_numel"] = sum(t.numel() for s in opt.state.values() for k, t in s.items() if k != "step")

    # canonical layout == the single-process optimizer's state, keyed by FQN
    full = opt.full_state_dict()
    names = dict(ref.named_parameters())
    out["full_state_diff"] = max((full["state"][n][k] - ref_opt.state[p][k]).abs().max().item()
                                 for n, p in names.items() for k in ("exp_avg", "exp_avg_sq", "step"))
    out["full_groups"] = [(g["weight_decay"], g["params"]) for g in full["param_groups"]]

    # round trip: a fresh ZeRO-2 optimizer loads the reference (single-process) state and
    # continues; so does one restored from the sharded state_dict; all must match the reference
    fresh = _tiny()
    fresh.load_state_dict(ref.state_dict())
    fresh_opt = Zero2Optimizer(torch.optim.AdamW(_groups(fresh), lr=1.0), fresh)
    ref_full = {"state": {n: ref_opt.state[p] for n, p in names.items()},
                "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                  "params": [n for n, p in names.items() if any(p is q for q in g["params"])]}
                                 for g in ref_opt.param_groups]}
    fresh_opt.load_full_state_dict(ref_full)
    sharded = _tiny()
    sharded.load_state_dict(model.state_dict())
    sharded_opt = Zero2Optimizer(torch.optim.AdamW(_groups(sharded), lr=1.0), sharded)
    sharded_opt.load_state_dict(opt.state_dict())
    out["reloaded_lr"] = fresh_opt.param_groups[0]["lr"], sharded_opt.inner.param_groups[0]["lr"]
    _train(ref, ref_opt, range(STEPS, STEPS + 1))
    _train(fresh, fresh_opt, range(STEPS, STEPS + 1), rank, world)
    _train(sharded, sharded_opt, range(STEPS, STEPS + 1), rank, world)
    out["resume_diff"] = _max_diff(fresh, ref), _max_diff(sharded, ref)

    # ZeRO-2 in buckets of 100 elements (0.weight alone; one bucket spanning both param groups), one
    # reduction in flight, 2 accumulated micro-batches per step, all-reduce + broadcasts (its collectives on
    # gloo); then the reference's state loaded into that layout and one more step
    ref = _tiny()
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    _train(ref, ref_opt, range(STEPS))
    model = _tiny()
    small = 100 * 4 / 2**20
    opt = Zero2Optimizer(torch.optim.AdamW(_groups(model), lr=1e-2), model, bucket_cap_mb=small, in_flight=1,
                         collectives="all_reduce")
    out["buckets"] = [len(b.params) for b in opt._buckets]
    for step in range(STEPS):
        x, y = (_local(t, rank, world) for t in _batch(step))
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            (F.mse_loss(model(xs), ys) / 2).backward()
            out["grads_between"] = [p.grad for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    out["bucketed_diff"] = _max_diff(model, ref)
    full = opt.full_state_dict()
    out["bucketed_state_diff"] = max((full["state"][n][k] - ref_opt.state[p][k]).abs().max().item()
                                     for n, p in ref.named_parameters() for k in ("exp_avg", "exp_avg_sq", "step"))
    bucketed = _tiny()
    bucketed.load_state_dict(ref.state_dict())
    bucketed_opt = Zero2Optimizer(torch.optim.AdamW(_groups(bucketed), lr=1.0), bucketed, bucket_cap_mb=small)
    bucketed_opt.load_full_state_dict({"state": {n: ref_opt.state[p] for n, p in ref.named_parameters()},
                                       "param_groups": ref_full["param_groups"]})
    _train(bucketed, bucketed_opt, range(STEPS, STEPS + 1), rank, world)
    _train(ref, ref_opt, range(STEPS, STEPS + 1))
    out["bucketed_resume_diff"] = _max_diff(bucketed, ref)

    # ZeRO-1: DDP all-reduces the gradients, ZeroRedundancyOptimizer shards the state
    ref = _tiny()
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    _train(ref, ref_opt, range(STEPS))
    model = _tiny()
    ddp = nn.parallel.DistributedDataParallel(model)
    z1 = make_zero1_optimizer(torch.optim.AdamW(_groups(model), lr=1e-2))
    _train(ddp, z1, range(STEPS), rank, world)
    out["zero1_diff"] = _max_diff(model, ref)
    out["zero1_groups"] = [(type(z1.optim).__name__, g["weight_decay"], g["lr"]) for g in z1.param_groups]
    out["zero1_local_params"] = sum(p.numel() for g in z1.optim.param_groups for p in g["params"])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_zero1_and_zero2_match_single_process(world: int) -> None:
    results = run_distributed(_zero_worker, world, timeout=180)
    n_params = 183
    shard = math.ceil(n_params / world)
    for r in results:
        assert r["zero2_diff"] < 1e-5
        assert r["shard"] == shard
        assert all(g is None for step in r["grads_after_step"] for g in step)  # only the shard remains
        # full params; the gradient shard; m and v shards plus one fp32 'step' per param group
        assert r["state_bytes"] == {"params": shard * world * 4, "grads": shard * 4, "optimizer_state": 2 * shard * 4 + 8}
        assert r["state_numel"] == 2 * shard
        assert r["full_state_diff"] < 1e-5
        assert r["full_groups"] == [(0.1, ["0.weight", "2.weight"]), (0.0, ["0.bias", "2.bias"])]
        assert r["reloaded_lr"] == (1e-2, 1e-2)
        assert max(r["resume_diff"]) < 1e-5
        assert r["buckets"] == [1, 3]
        assert all(g is None for g in r["grads_between"])  # freed into the buckets during backward
        assert r["bucketed_diff"] < 1e-5 and r["bucketed_state_diff"] < 1e-5
        assert r["bucketed_resume_diff"] < 1e-5
        assert r["zero1_diff"] < 1e-5
        assert r["zero1_groups"] == [("AdamW", 0.1, 1e-2), ("AdamW", 0.0, 1e-2)]
    assert sum(r["zero1_local_params"] for r in results) == n_params  # ZeRO-1 partitions the params


def test_zero2_refuses_foreign_params() -> None:  # checked before any collective: no process group needed
    with pytest.raises(ValueError, match="not in the module"):
        Zero2Optimizer(torch.optim.AdamW(nn.Linear(2, 2).parameters()), _tiny())


def _zero2_branch_worker(rank: int, world: int) -> str:
    model = nn.ModuleDict({"used": nn.Linear(2, 2), "branch": nn.Linear(2, 2)})  # branch: no gradient this step
    opt = Zero2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, name="lp_zero2")
    model["used"](torch.ones(1, 2)).sum().backward()
    try:
        opt.step()
    except ValueError as e:  # ConfigError
        return str(e)
    return "stepped"


def test_zero2_lines_say_lp_zero2() -> None:
    """zero2's one-line stops start with the strategy's name (lp_zero2:), as every other strategy's do (issue
    35): its checks before launch, and the optimizer's stop on a parameter without a gradient (a branch), which
    the strategy names so (``tests/test_sync_bn_unused.py::test_unused_parameters`` runs it under Lightning)."""
    with pytest.raises(ValueError, match=r"^lp_zero2: collectives must be one of"):
        Zero2Strategy(collectives="x")
    with pytest.raises(ValueError, match=r"^lp_zero2: zero2 flattens all parameters"):
        Zero2Strategy().validate_setup(2, nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()))
    [line] = run_distributed(_zero2_branch_worker, 1, timeout=120)
    assert line.startswith("lp_zero2: parameter(s) branch.weight, branch.bias got no gradient on any rank"), line
    assert "\n" not in line


# --- FSDP ------------------------------------------------------------------------------------------
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)


def _gpt_batch(step: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=torch.Generator().manual_seed(step))


def _gpt_train(model: nn.Module, opt: torch.optim.Optimizer, rank: int = 0, world: int = 1) -> list[float]:
    """Train; return the loss over the global batch at every step (mean of the ranks' means)."""
    losses = []
    for step in range(STEPS):
        tokens = _local(_gpt_batch(step), rank, world)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        global_loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
    return losses


def _fsdp_worker(rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...], prefetch: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    # SGD with momentum, not Adam: Adam divides by sqrt(v), which turns float-rounding noise in
    # near-zero gradients (e.g. rarely seen token rows) into lr-sized parameter differences
    torch.manual_seed(0)
    ref = GPT(CFG)
    ref_losses = _gpt_train(ref, torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9))

    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    apply_fsdp(model, mesh=mesh, units=resolve_units(model, "Block"), prefetch=prefetch)
    losses = _gpt_train(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), rank, world)
    local = sum(p.to_local().numel() for p in model.parameters())
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    diff = max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())
    return {"diff": diff, "losses": (losses, ref_losses), "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()), "local": local,
            "n_params": CFG.n_params}


@pytest.mark.parametrize(("world", "shape", "names", "prefetch"), [
    (2, (2,), ("dp_shard",), 1),
    (4, (2, 2), ("dp_replicate", "dp_shard"), 2),  # HSDP: shard within pairs, replicate across them
])
def test_fsdp_matches_single_process(world, shape, names, prefetch) -> None:
    results = run_distributed(_fsdp_worker, world, shape, names, prefetch, timeout=180)
    for r in results:
        assert r["diff"] < 1e-5
        assert r["losses"][0] == pytest.approx(r["losses"][1], abs=1e-5)  # loss parity
        assert r["all_dtensor"]
        assert r["local"] < r["n_params"] / shape[-1] + 200  # about 1/shard of the params (+ row padding)


def test_resolve_units() -> None:
    model = GPT(CFG)
    assert resolve_units(model, "Block") == ["blocks.0", "blocks.1"]
    assert resolve_units(model, ["blocks.1", "head"]) == ["blocks.1", "head"]
    assert resolve_units(model, "MLP") == ["blocks.0.mlp", "blocks.1.mlp"]
    # size threshold: the smallest subtrees holding at least that many not-yet-claimed params
    block = sum(p.numel() for p in model.blocks[0].parameters())  # 12704; embed 8704, head 8256
    assert resolve_units(model, block) == ["blocks.0", "blocks.1"]
    # 8192-param embedding table and vocabulary projection, 8352-param MLPs
    assert resolve_units(model, 8000) == ["embed.tok", "blocks.0.mlp", "blocks.1.mlp", "head.lm_head"]
    assert resolve_units(model, 10**6) == []
    with pytest.raises(ValueError, match="block classes: Embedding, Block, CausalSelfAttention, MLP, Head"):
        resolve_units(model, "Blok")
    with pytest.raises(ValueError, match="unknown FSDP unit path 'blocks.7'"):
        resolve_units(model, ["blocks.7"])
    with pytest.raises(ValueError, match="container"):
        resolve_units(model, ["blocks"])
