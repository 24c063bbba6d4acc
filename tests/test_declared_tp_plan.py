"""A refusal's advice followed (issue 35): a tensor-parallel plan the user declares over a Hugging Face model.

``lp_tensor_parallel`` refuses StableLM (transformers declares no plan for it and none is derived) with
"... declare parallel_plan().tp_plan (...) or set tp=1". Following that advice -- a LightningModule of
one's own around a tiny StableLM built from a config (no download), declaring colwise q/k/v, gate and up,
rowwise o and down over ``net.model.layers.*`` -- once passed every check and then crashed at the first
forward: StableLM's attention views its projections by its global head counts
(``view(bsz, q_len, self.num_heads, head_dim)``), which a rank holding half of the heads cannot. A
declared plan now gets what the derived plans have (``hf.plan.declared_head_division``): the attention
module's head counts divided by tp, and checked before launch as sizes tp must divide.

- ``test_stablelm_refusal_advice_followed_trains_as_one_device``: the refusal (before launch, one line,
  naming the advice), then the advice followed: 8 SGD steps in fp32 on gloo at 2 ranks (tp=2; grouped
  query attention, 4 heads and 2 key/value heads, so both counts are divided), each step's loss within
  rtol 1e-5 of ``lp_single``'s (``tests/test_family_matrix.classify``), and the steps move the loss far
  beyond that; GPT-2's layout declared by hand alike (its packed ``c_attn`` split by ``split_size``, a
  width the derived plan divides too). A key/value head count tp does not divide (tp=4 over 2) and
  StableLM's ``qk_layernorm`` (a LayerNorm per head, for all heads, which a rank would apply to the wrong
  ones) are refused before launch in one line. Two process starts: lp_single and the before-launch
  checks in one, tp=2 in one.
- ``test_declared_plan_gets_head_counts_divided``: the resolved plan itself, in this process (BLOOM's
  ALiBi, sized by a head count the model holds above its attention modules, refused).
- ``test_declared_plan_refusal_before_launch_is_one_line``: the strategy's own check before launch.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests import test_family_matrix as matrix

LAYERS = "net.model.layers.*"
#: the plan the refusal's advice asks for: Megatron-LM's layout over StableLM's decoder layers
STABLELM_PLAN = {f"{LAYERS}.self_attn.q_proj": "colwise", f"{LAYERS}.self_attn.k_proj": "colwise",
                 f"{LAYERS}.self_attn.v_proj": "colwise", f"{LAYERS}.self_attn.o_proj": "rowwise",
                 f"{LAYERS}.mlp.gate_proj": "colwise", f"{LAYERS}.mlp.up_proj": "colwise",
                 f"{LAYERS}.mlp.down_proj": "rowwise"}
#: GPT-2's own layout declared by hand (its attention splits the packed q|k|v by ``split_size``, a width)
GPT2_PLAN = {"net.transformer.h.*.attn.c_attn": "packed_colwise:3", "net.transformer.h.*.attn.c_proj": "rowwise",
             "net.transformer.h.*.mlp.c_fc": "colwise", "net.transformer.h.*.mlp.c_proj": "rowwise"}
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=256, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             hidden_dropout=0.0, attention_dropout=0.0)

#: put before the matrix script's driver: StableLM as the matrix builds its families, and the user's own
#: LightningModule declaring a plan: "stablelm_plan" (the advice followed), "stablelm_qk_plan" (with
#: qk_layernorm=True), "gpt2_plan" (GPT-2, whose plan is otherwise derived, declared by hand)
EXTRA = textwrap.dedent(f'''
    from lightning_par.parallel.contract import ParallelPlan

    FAMILIES["stablelm"] = (AutoModelForCausalLM,
                            dict(num_key_value_heads=2, hidden_dropout=0.0, attention_dropout=0.0))
    DECLARED = {{  # name -> (model_type, config options, tp_plan)
        "stablelm_plan": ("stablelm", {{}}, {STABLELM_PLAN!r}),
        "stablelm_qk_plan": ("stablelm", {{"qk_layernorm": True}}, {STABLELM_PLAN!r}),
        "gpt2_plan": ("gpt2", {{}}, {GPT2_PLAN!r}),
    }}

    class WithPlan(L.LightningModule):
        """The refusal's advice followed: one's own LightningModule declaring parallel_plan().tp_plan."""

        def __init__(self, name):
            super().__init__()
            self.model_type, self.options, self.plan = DECLARED[name]
            self.net = None

        def configure_model(self):
            if self.net is None:
                cfg = AutoConfig.for_model(self.model_type, **SMALL, **FAMILIES[self.model_type][1], **self.options)
                self.net = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")

        def parallel_plan(self):
            return ParallelPlan(tp_plan=dict(self.plan), tp_divisible={{"attention heads": 4}})

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.net(input_ids=x, use_cache=False).logits
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    _MatrixLM = LM

    def LM(family):  # what the matrix's run() and before_launch() build
        return WithPlan(family) if family in DECLARED else _MatrixLM(family)
''')


def script() -> str:
    m = re.search(r"^STEPS = \d+$", matrix.SCRIPT, flags=re.M)
    assert m, "tests/test_family_matrix.py's SCRIPT has no 'STEPS = N' line to put StableLM before"
    return matrix.SCRIPT[:m.start()] + EXTRA + "\n" + matrix.SCRIPT[m.start():]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stablelm_refusal_advice_followed_trains_as_one_device(tmp_path: Path) -> None:
    text = script()
    one = matrix.run_script(tmp_path, 1, [("stablelm_plan", "lp_single"), ("gpt2_plan", "lp_single"),
                                          ("stablelm", "lp_tensor_parallel@2"),
                                          ("stablelm_plan", "lp_tensor_parallel@4"),
                                          ("stablelm_qk_plan", "lp_tensor_parallel@2")], text)
    refused = one["stablelm/lp_tensor_parallel@2"]  # the refusal whose advice this test follows
    assert refused.get("lines") == 1 and "declare parallel_plan().tp_plan" in refused["error"], refused
    assert "or set tp=1" in refused["error"], refused
    # a key/value head count tp does not divide: refused before launch, naming it (it once reached the forward)
    four = one["stablelm_plan/lp_tensor_parallel@4"]
    assert four.get("lines") == 1 and "does not divide" in four["error"], four
    assert "self_attn.num_key_value_heads=2" in four["error"], four
    # a table per head the plan cannot split (qk_layernorm): refused before launch in one line
    qk = one["stablelm_qk_plan/lp_tensor_parallel@2"]
    assert qk.get("lines") == 1 and "q_layernorm" in qk["error"] and "use tp=1" in qk["error"], qk
    got = matrix.run_script(tmp_path, 2, [(name, "lp_tensor_parallel") for name in ("stablelm_plan", "gpt2_plan")],
                            text)
    for name in ("stablelm_plan", "gpt2_plan"):
        ref = one[f"{name}/lp_single"]
        assert "error" not in ref and len(ref["losses"]) == 8 and np.isfinite(ref["losses"]).all(), ref
        assert np.ptp(ref["losses"]) > 1e-3, ref  # it trains: the steps move the loss far beyond the tolerance
        cell = got[f"{name}/lp_tensor_parallel"]
        outcome = matrix.classify(cell, ref["losses"])  # every step's loss within rtol 1e-5 of lp_single's
        rel = max(abs(a - b) / abs(b) for a, b in zip(cell["losses"], ref["losses"])) if "error" not in cell else None
        print(f"  {name} (declared plan), lp_tensor_parallel tp=2: {outcome} (largest relative difference {rel})")
        assert outcome == "parity", (name, outcome, cell, ref)


def _stablelm_module(**options: object) -> nn.Module:
    import transformers

    from lightning_par.parallel.contract import ParallelPlan

    class Mine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            cfg = transformers.AutoConfig.for_model("stablelm", **{**SMALL, **options})
            self.net = transformers.AutoModelForCausalLM.from_config(cfg)

        def parallel_plan(self) -> ParallelPlan:
            return ParallelPlan(tp_plan=dict(STABLELM_PLAN), tp_divisible={"attention heads": 4})

    return Mine()


def test_declared_plan_gets_head_counts_divided() -> None:
    """The resolved plan: the attention modules' head counts divided (one pattern entry, as the split q/k/v's),
    checked as sizes tp must divide; the MLP (no head counts) and a model of one's own left alone; a per-head
    table refused; an attention module the plan names itself left to the plan."""
    from lightning_par.parallel.contract import ParallelPlan
    from lightning_par.parallel.discovery import resolve_plan

    torch.manual_seed(0)
    plan = resolve_plan(_stablelm_module()).plan
    assert plan.tp_plan == {**STABLELM_PLAN, f"{LAYERS}.self_attn": "divide_attrs:num_heads,num_key_value_heads"}
    assert plan.tp_divisible == {"attention heads": 4, "net.model.layers.0.self_attn.num_heads": 4,
                                 "net.model.layers.0.self_attn.num_key_value_heads": 2}
    assert not plan.tp_refusal

    qk = resolve_plan(_stablelm_module(qk_layernorm=True)).plan
    assert qk.tp_plan == {} and "\n" not in qk.tp_refusal, qk
    assert "net.model.layers.0.self_attn.q_layernorm (StableLmLayerNormPerHead)" in qk.tp_refusal
    assert qk.tp_refusal.endswith("use tp=1 (a data-parallel or sharded strategy)")

    own = _stablelm_module()
    own.parallel_plan = lambda: ParallelPlan(  # the user divides the counts: left as declared
        tp_plan={**STABLELM_PLAN, f"{LAYERS}.self_attn": "divide_attrs:num_heads,num_key_value_heads"})
    assert resolve_plan(own).plan.tp_plan == own.parallel_plan().tp_plan

    class Bloom(nn.Module):  # ALiBi biases built by the model for all heads: refused, not divided
        def __init__(self) -> None:
            super().__init__()
            import transformers

            cfg = transformers.AutoConfig.for_model("bloom", n_embed=64, n_head=4, n_layer=2, vocab_size=256)
            self.net = transformers.AutoModelForCausalLM.from_config(cfg)

        def parallel_plan(self) -> ParallelPlan:
            return ParallelPlan(tp_plan={"net.transformer.h.*.self_attention.query_key_value": "colwise",
                                         "net.transformer.h.*.self_attention.dense": "rowwise"})

    bloom = resolve_plan(Bloom()).plan
    assert bloom.tp_plan == {} and "net.transformer (BloomModel) holds a head count (num_heads=4)" in bloom.tp_refusal

    class Attention(nn.Module):  # not a Hugging Face model: sizes its views as it likes
        def __init__(self) -> None:
            super().__init__()
            self.num_heads, self.q = 4, nn.Linear(8, 8)

        def parallel_plan(self) -> ParallelPlan:
            return ParallelPlan(tp_plan={"q": "colwise"})

    assert resolve_plan(Attention()).plan.tp_plan == {"q": "colwise"}


def test_declared_plan_refusal_before_launch_is_one_line() -> None:
    """The strategy's check before launch says the refusal in one line (no process started)."""
    from lightning_par.strategies.tensor_parallel import TensorParallelStrategy

    with pytest.raises(ValueError) as e:
        TensorParallelStrategy(tp=2).validate_setup(2, _stablelm_module(qk_layernorm=True))
    assert "\n" not in str(e.value) and "q_layernorm" in str(e.value), e.value
    with pytest.raises(ValueError, match=r"does not divide net\.model\.layers\.0\.self_attn\.num_key_value_heads=2"):
        TensorParallelStrategy(tp=4).validate_setup(4, _stablelm_module())
    TensorParallelStrategy(tp=2).validate_setup(2, _stablelm_module())  # accepted
