"""Pipeline cuts across transformers' registry: every causal-LM family is built from a tiny config
(``models/hf_registry.tiny_config``), cut into stages by its own plan (``hf.plan.hf_layers``: the
config's ``base_model_pp_plan``, or for a family declaring none -- GPT-2, OPT, Falcon, Bloom, ... --
the plan derived from its forward, ``parallel/hf/pp_derive.py``, with the layers a stage may start
at), and the stages -- each running the model's own forward around its layers
(``parallel/hf/stages.py``) -- are chained in one process. Their logits and every parameter's
gradient must equal the whole model's (rtol 1e-5) at two cuts: between decoder layers, and right
before the head (for a derived plan: the allowed stage starts nearest to those). One process
suffices: what a pipeline adds across ranks (the send/receive of the boundary tensor, the
schedules) does not depend on the family and is tested at 2 and 4 ranks elsewhere
(tests/test_pipeline_own_forward.py, test_e2e_model_parallel.py, test_family_matrix.py).

Outcomes: **parity**; **refused** -- one line before launch (``check_hf_pipeline``: a forward that
cannot be cut; ``hf.pp_derive``: no plan can be derived); **unbuildable** -- transformers cannot build or run the family whole at the tiny
sizes; **failed** -- the test fails. Calling decoder layers with hidden states alone (the old
stage code) fails this test for every family whose layers need a mask or rotary tables.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning_par.parallel.hf.stages import hf_stage_runner

MAX_PARAMS = 5_000_000
SEQ = 16


def families_with_pp_plan() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from lightning_par.models.hf.registry import causal_lm_types

    return [mt for mt in causal_lm_types() if getattr(CONFIG_MAPPING[mt], "base_model_pp_plan", None)]


def families_without_pp_plan() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from lightning_par.models.hf.registry import causal_lm_types

    return [mt for mt in causal_lm_types() if not getattr(CONFIG_MAPPING[mt], "base_model_pp_plan", None)]


def two_cuts(n: int, starts: tuple[int, ...]) -> list[list[int]]:
    """Between decoder layers and right before the head: the allowed stage start nearest the middle,
    and the last one (``starts``: ``ParallelPlan.stage_starts``; () = every layer)."""
    allowed = [i for i in (starts or range(n)) if i > 0]
    mid = min(allowed, key=lambda i: (abs(i - n // 2), i))
    return [[0, mid, n], [0, allowed[-1], n]] if allowed[-1] != mid else [[0, mid, n]]


def _one(model_type: str) -> tuple[str, str]:
    from transformers import AutoModelForCausalLM

    from lightning_par.models.hf.registry import tiny_config
    from lightning_par.parallel.hf.stages import check_hf_pipeline
    from lightning_par.parallel.hf.plan import hf_layers, hf_stage_starts
    from lightning_par.parallel.pipeline.schedule import build_stage_modules

    try:
        config = tiny_config(model_type)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        if sum(p.numel() for p in meta.parameters()) > MAX_PARAMS:
            return "unbuildable", "more parameters than a tiny model at the tiny sizes"
        torch.manual_seed(0)
        whole = AutoModelForCausalLM.from_config(config).float().eval()  # no dropout: one process, two passes
        ids = torch.randint(3, 200, (2, SEQ), generator=torch.Generator().manual_seed(1))
        want = whole(input_ids=ids, use_cache=False).logits
        F.cross_entropy(want[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
    except Exception as e:  # noqa: BLE001 - transformers' own model fails at the tiny sizes, whole
        return "unbuildable", f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    grads = {n: p.grad.clone() for n, p in whole.named_parameters() if p.grad is not None}
    layers = hf_layers(whole)
    starts, refusal = hf_stage_starts(whole)
    if not layers:  # no plan derived (the reason), or hf_layers logged the module a declared plan names and lacks
        return "refused", refusal or f"{type(whole).__name__}: its pipeline plan names a module the model does not have"
    try:
        check_hf_pipeline(meta, layers, seq_len=SEQ, starts=starts)
    except ValueError as e:
        return "refused", str(e)
    if len(starts or layers) < 2:
        return "refused", f"{type(whole).__name__}: no stage can start after its first layer"
    n = len(layers)
    for bounds in two_cuts(n, starts):
        whole.zero_grad(set_to_none=True)
        try:
            x = ids
            for stage in build_stage_modules(whole, layers=layers, boundaries=bounds, stage_indices=range(2), stage_runner=hf_stage_runner):
                x = stage(x)
            F.cross_entropy(x[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
            torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5, msg=f"logits, cut at {bounds}")
            for name, p in whole.named_parameters():
                if name in grads:
                    torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6,
                                               msg=f"grad of {name}, cut at {bounds}")
        except Exception as e:  # noqa: BLE001 - a crash or a mismatch: this family's failure
            return "failed", f"{type(e).__name__}: {' '.join(str(e).split())[:240]}"
    return "parity", ""


def readme_counts_match(outcome: dict[str, tuple[str, str]], pattern: str) -> None:
    """With the transformers docs/huggingface.md's counts were measured on, they are this walk's (``pattern``:
    a regular expression over that page whose groups are total, parity, unbuildable, refused)."""
    import re
    from pathlib import Path

    import transformers

    from lightning_par.parallel.hf.tp_verified import MEASURED_WITH

    if not transformers.__version__.startswith(MEASURED_WITH):
        return  # another transformers: other families, other counts; the outcome checks above still hold
    readme = " ".join((Path(__file__).resolve().parents[1] / "docs" / "huggingface.md").read_text().split())
    m = re.search(pattern, readme)
    assert m, f"docs/huggingface.md lacks the sentence {pattern!r}"
    kinds = [kind for kind, _ in outcome.values()]
    got = (len(outcome), kinds.count("parity"), kinds.count("unbuildable"), kinds.count("refused"))
    assert tuple(int(g) for g in m.groups()) == got, (m.group(0), got)


def walk(families: list[str]) -> dict[str, tuple[str, str]]:
    """Every family's outcome, printed with the counts; asserts none failed and every refusal is one line."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    try:
        outcome = {mt: _one(mt) for mt in families}
    finally:
        logging.disable(logging.NOTSET)
    counts: dict[str, int] = {}
    for mt, (kind, why) in outcome.items():
        counts[kind] = counts.get(kind, 0) + 1
        print(f"  {mt:28s} {kind:12s} {why[:160]}")
    print(counts)
    assert not {mt: why for mt, (kind, why) in outcome.items() if kind == "failed"}
    for mt, (kind, why) in outcome.items():
        if kind == "refused":
            assert why and "\n" not in why, (mt, why)
    return outcome


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_family_with_a_pipeline_plan_cuts_exactly_or_is_refused_in_one_line() -> None:
    families = families_with_pp_plan()
    assert len(families) >= 50  # the registry is read, not a hand-picked list
    outcome = walk(families)
    assert {mt for mt, (kind, _) in outcome.items() if kind == "parity"} >= {
        "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen2_moe"}
    readme_counts_match(outcome, r"declares a `base_model_pp_plan` \((\d+) in transformers [\d.]+\).*?"
                                 r"\*\*(\d+) give the whole model's logits.*?; (\d+) cannot be built.*?(\d+) are refused")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_family_without_a_pipeline_plan_cuts_exactly_on_a_derived_plan_or_is_refused_in_one_line() -> None:
    families = families_without_pp_plan()
    assert len(families) >= 50  # the registry is read, not a hand-picked list
    outcome = walk(families)
    assert {mt for mt, (kind, _) in outcome.items() if kind == "parity"} >= {"gpt2", "opt", "falcon", "bloom"}
    readme_counts_match(outcome, r"walks the (\d+) causal-LM families that declare no plan: \*\*(\d+) give the whole "
                                 r"model's logits.*?, (\d+) cannot be built or run whole at tiny sizes, (\d+) are refused")
