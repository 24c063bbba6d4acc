"""Hugging Face MoE families under expert parallelism, walked from transformers' own registry.

Every causal-LM family whose config declares a ``base_model_ep_plan`` (its experts module, style
``ep_dispatch_experts``) is built from a tiny config (``models/hf_registry.tiny_config``) and trained
4 SGD steps at 2 ranks, each rank on its own half of the batch: once whole on one process over the
full batch, once with the experts split over ep=2 by ``parallel/tensor/expert_parallel.py`` (tokens sent to
their expert's rank by all-to-all, the module's own forward on the local experts), the non-expert
gradients averaged over the ranks. The outcome is one of:

- **parity**: the mean of the ranks' losses equals the whole model's loss on the whole batch at every
  step, and every parameter (the experts' gathered) equals it after training (rtol 1e-5);
- **refused**: one line before anything runs (experts that ep=2 cannot split);
- **failed**: a crash or a mismatch: the test fails;
- **unbuildable**: transformers itself cannot build or run the family at the tiny sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.dist import run_distributed

STEPS = 4
MAX_PARAMS = 5_000_000


def _one(model_type: str, mesh) -> tuple[str, str]:  # noqa: ANN001
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from lightning_par.parallel.tensor.expert_parallel import apply_expert_parallel, expert_parameters
    from lightning_par.parallel.sharding.gradients import average_gradients
    from lightning_par.parallel.hf.experts import install
    from lightning_par.parallel.hf.plan import hf_parallel_plan

    try:
        config = moe_tiny_config(model_type)
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if n > MAX_PARAMS:
            return "unbuildable", f"{n / 1e6:.0f}M parameters at the tiny sizes"
        torch.manual_seed(0)
        whole = AutoModelForCausalLM.from_config(config).float()
    except Exception as e:  # noqa: BLE001 - transformers' own refusal of the tiny sizes
        return "unbuildable", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    plan = hf_parallel_plan(whole)
    if not plan.experts:
        return "refused", f"{type(whole).__name__}: no experts module found from base_model_ep_plan"
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = torch.randint(3, 256, (2 * world, 17), generator=torch.Generator().manual_seed(1))
    mine = ids.chunk(world)[rank]
    note = ""
    try:
        with torch.no_grad():  # routing that samples in training (PhiMoE's Gumbel sparsemixer) differs per process
            if not torch.equal(*(whole(input_ids=ids[:, :-1], use_cache=False).logits for _ in range(2))):
                whole.eval()  # compared with the deterministic routing; gradients flow the same
                note = "random routing in training: compared in eval mode"
    except Exception as e:  # noqa: BLE001 - transformers' own model fails at the tiny sizes, unsplit
        return "unbuildable", f"unsplit: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    split = copy.deepcopy(whole)

    def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))

    def train(model: torch.nn.Module, batch: torch.Tensor, sync=None) -> list[float]:  # noqa: ANN001
        opt, losses = torch.optim.SGD(model.parameters(), lr=0.5), []
        for _ in range(STEPS):
            loss = loss_of(model, batch)
            loss.backward()
            if sync is not None:
                sync(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        return losses

    try:
        ref = train(whole, ids)
    except Exception as e:  # noqa: BLE001 - transformers' own model fails at the tiny sizes, unsplit
        return "unbuildable", f"unsplit: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    try:
        apply_expert_parallel(split, ep_mesh=mesh, experts=plan.experts, install=install)
    except ValueError as e:
        return "refused", f"{type(whole).__name__}: {e}"

    def sync(model: torch.nn.Module) -> None:  # data parallel over the same ranks for the rest
        experts = {id(p) for p in expert_parameters(model)}
        average_gradients([p for p in model.parameters() if id(p) not in experts], mesh.get_group())

    try:
        got = train(split, mine, sync)
    except Exception as e:  # noqa: BLE001 - reported as this family's failure
        return "failed", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    try:
        mean = torch.tensor(got)
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, torch.tensor(ref), rtol=1e-5, atol=1e-6)
        params = dict(whole.named_parameters())
        for name, p in split.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            torch.testing.assert_close(full.detach(), params[name].detach(), rtol=1e-5, atol=1e-6, msg=name)
    except AssertionError as e:
        return "failed", f"mismatch: {' '.join(str(e).split())[:300]} (losses {got} vs {ref})"
    return "parity", note


def moe_tiny_config(model_type: str):  # noqa: ANN201
    """The registry's tiny config with every layer an MoE layer (at 2 layers, families that keep their
    first layers dense -- ``first_k_dense_replace``, ``mlp_layer_types``, ``mlp_only_layers``,
    ``num_dense_layers`` -- have none) and one expert group; then, if that does not build and run a
    forward, with the sizes some families need: multi-head latent attention's rotary ``head_dim``, a
    shared expert, attention layer types. The first candidate that runs is used."""
    from transformers import AutoModelForCausalLM

    from lightning_par.models.hf.registry import tiny_config

    base = tiny_config(model_type)
    n = base.num_hidden_layers
    want = {"first_k_dense_replace": 0, "mlp_layer_types": ["sparse"] * n, "mlp_only_layers": [],
            "decoder_sparse_step": 1, "num_dense_layers": 0, "n_group": 1, "topk_group": 1, "num_expert_group": 1}
    moe = {k: v for k, v in want.items() if getattr(base, k, None) is not None}
    extra: dict = {}
    if getattr(base, "qk_rope_head_dim", None):
        extra["head_dim"] = base.qk_rope_head_dim
    if hasattr(base, "n_shared_experts") and base.n_shared_experts is None:
        extra["n_shared_experts"] = 1
    if hasattr(base, "layer_types") and base.layer_types is None:
        extra["layer_types"] = ["full_attention"] * n
    candidates = [moe] + [{**moe, **dict(list(extra.items())[:i])} for i in range(1, len(extra) + 1)]
    for fix in candidates:
        try:
            config = tiny_config(model_type, **fix)
            with torch.no_grad():
                AutoModelForCausalLM.from_config(config)(input_ids=torch.arange(3, 19).reshape(1, 16), use_cache=False)
            return config
        except Exception:  # noqa: BLE001,S112 - the next candidate; the last one's failure is reported
            continue
    return tiny_config(model_type, **candidates[-1])


def _walk(rank: int, world: int, families: list[str]) -> dict[str, tuple[str, str]]:
    import logging
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    out = {}
    for mt in families:
        try:
            out[mt] = _one(mt, mesh)
        except Exception as e:  # noqa: BLE001 - any other exception is this family's failure
            out[mt] = ("failed", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    return out


def families_with_ep_plan() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from lightning_par.models.hf.registry import causal_lm_types

    out = []
    for mt in causal_lm_types():
        plan = getattr(CONFIG_MAPPING[mt], "base_model_ep_plan", None) or {}
        if "ep_dispatch_experts" in plan.values():
            out.append(mt)
    return out


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_moe_family_runs_expert_parallel_or_is_refused_in_one_line() -> None:
    families = families_with_ep_plan()
    assert len(families) >= 20 and {"mixtral", "qwen2_moe", "qwen3_moe"} <= set(families)
    r0, r1 = run_distributed(_walk, 2, families, timeout=1100)
    assert r0.keys() == r1.keys()
    counts: dict[str, int] = {}
    for mt in families:
        kind, why = r0[mt]
        counts[kind] = counts.get(kind, 0) + 1
        print(f"  {mt:28s} {kind:12s} {why[:160]}")
    print(counts)
    failed = {mt: r0[mt][1] for mt in families if r0[mt][0] == "failed"}
    assert not failed, failed
    assert {mt for mt in families if r0[mt][0] == "parity"} >= {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3",
                                                                "gpt_oss", "olmoe", "jamba"}
    for mt in families:
        if r0[mt][0] == "refused":
            assert r0[mt][1] and "\n" not in r0[mt][1], (mt, r0[mt])
