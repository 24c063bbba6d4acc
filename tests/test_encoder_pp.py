"""Pipeline parallelism for encoder-only models (issue 19): BERT and RoBERTa masked LMs, whose pipeline
plan is derived from their forward (``parallel/hf/pp_derive.py``): the embeddings, each
``encoder.layer``, the MLM head. Each stage runs the model's own forward (``parallel/hf/stages.py``):
the first one from the input ids, every later one from ``inputs_embeds`` (the embeddings module of an
earlier stage hands that activation on), so the extended attention mask is the whole model's. The
word table is tied to the MLM decoder: the first and the last stage each hold a copy, their gradients
summed every step (``parallel/pipeline/stage_ties.py``); the decoder's bias (tied to the head's own) stays
inside the head.

- in one process: the derived plan, every cut of it chained by hand gives the whole model's logits
  and every gradient; T5 and BART (encoder-decoder) refused in one line that says why;
- Lightning: a LightningModule whose batch is (masked ids, labels with -100 where not masked) and
  whose ``loss_fn`` is ``cross_entropy(ignore_index=-100)``, trained 8 SGD steps in fp32 by a plain
  ``Trainer`` under ``lp_pipeline`` at 2 ranks and ``lp_3d`` at 8 (pp=2 x tp=2 x dp=2), each step's
  loss within rtol 1e-5 of ``lp_single``'s; one process start per world size for all cells. Every sequence has the same masked positions
  (every 4th token), so each micro-batch's mean over its masked tokens averages to the batch's.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning_par.parallel.hf.stages import hf_stage_runner

from tests.test_family_matrix import run_script as matrix_run_script

SMALL = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=256,
             max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def masked_lm(family: str, layers: int = 2):
    from transformers import AutoConfig, AutoModelForMaskedLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, num_hidden_layers=layers, **SMALL)
    return AutoModelForMaskedLM.from_config(cfg, attn_implementation="eager").eval()


@pytest.mark.parametrize("family,prefix,head", [("bert", "bert", "cls"), ("roberta", "roberta", "lm_head")])
def test_the_encoder_plan_is_derived_and_every_cut_is_the_whole_model(family, prefix, head):
    from lightning_par.parallel.hf.stages import check_hf_pipeline
    from lightning_par.parallel.hf.plan import hf_parallel_plan
    from lightning_par.parallel.pipeline.schedule import build_stage_modules

    model = masked_lm(family)
    plan = hf_parallel_plan(model)
    assert plan.pp_refusal == ""
    assert plan.layers == (f"{prefix}.embeddings", f"{prefix}.encoder.layer.0", f"{prefix}.encoder.layer.1", head)
    assert plan.stage_starts == (0, 1, 2, 3)
    check_hf_pipeline(model, plan.layers, starts=plan.stage_starts)
    ids = torch.randint(4, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids).logits
    F.cross_entropy(want.flatten(0, 1), ids.flatten()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for bounds in ([0, 1, 4], [0, 2, 4], [0, 3, 4], [0, 1, 2, 3, 4]):
        model.zero_grad(set_to_none=True)
        x = ids
        for stage in build_stage_modules(model, layers=plan.layers, boundaries=bounds,
                                         stage_indices=range(len(bounds) - 1), stage_runner=hf_stage_runner):
            x = stage(x)
        F.cross_entropy(x.flatten(0, 1), ids.flatten()).backward()
        torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)
        for n, p in model.named_parameters():  # the tied word table: the sum of both uses' gradients
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6, msg=f"{n} at {bounds}")


def test_encoder_decoder_models_are_refused_in_one_line_that_says_why():
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    from lightning_par.parallel.hf.plan import hf_parallel_plan

    with torch.device("meta"):
        models = [T5ForConditionalGeneration(T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                                                      vocab_size=256)),
                  BartForConditionalGeneration(BartConfig(d_model=64, encoder_layers=2, decoder_layers=2,
                                                          encoder_attention_heads=4, decoder_attention_heads=4,
                                                          encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256))]
    for model in models:
        plan = hf_parallel_plan(model)
        assert plan.layers == ()
        line = plan.pp_refusal
        assert "\n" not in line and "encoder-decoder" in line and "cross-attention" in line
        assert "not support" in line and " use " not in line and "untie" not in line  # no advice to follow


SCRIPT = textwrap.dedent('''
    import json, os, sys, warnings, logging
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    import torch.nn.functional as F
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import AutoConfig, AutoModelForMaskedLM
    import lightning_par.strategies  # registers lp_single, lp_pipeline, ...

    SMALL = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=256,
                 max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    MASK = 3

    class MLM(L.LightningModule):
        def __init__(self, family, layers):
            super().__init__()
            self.family, self.layers, self.net = family, layers, None

        def configure_model(self):
            if self.net is None:
                cfg = AutoConfig.for_model(self.family, num_hidden_layers=self.layers, **SMALL)
                self.net = AutoModelForMaskedLM.from_config(cfg, attn_implementation="eager")

        def loss_fn(self, logits, target):  # a pipeline's last stage calls it
            return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.loss_fn(self.net(input_ids=x).logits, y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Losses(L.Callback):
        def __init__(self):
            self.values = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.values.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    def data():  # arithmetic runs, every 4th token masked and predicted
        g = torch.Generator().manual_seed(1)
        start, stride = torch.randint(0, 252, (64, 1), generator=g), torch.randint(1, 4, (64, 1), generator=g)
        ids = (start + stride * torch.arange(16)) % 252 + 4
        labels = torch.full_like(ids, -100)
        labels[:, ::4] = ids[:, ::4]
        inputs = ids.clone()
        inputs[:, ::4] = MASK
        return TensorDataset(inputs, labels)

    def run(strategy, devices, family, layers):
        L.seed_everything(0, verbose=False)
        losses = Losses()
        trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=8, callbacks=[losses],
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        dp = {"lp_single": 1, "lp_pipeline": 1, "lp_3d": 2}[strategy]  # 3d at 8 ranks: pp=2 x tp=2 x dp=2
        trainer.fit(MLM(family, layers), DataLoader(data(), batch_size=8 // dp, shuffle=False))
        return losses.values

    out, devices, cells = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    result = {f"{fam}{layers}/{strategy}": run(strategy, devices, fam, layers) for fam, layers, strategy in cells}
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(result, f)
''')

CELLS = [("bert", 4), ("roberta", 2)]


def run_script(tmp_path: Path, devices: int, cells: list) -> dict:
    return matrix_run_script(tmp_path, devices, cells, SCRIPT)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """Every cell's losses under ``lp_single`` (one process start)."""
    return run_script(tmp_path_factory.mktemp("single"), 1, [(f, n, "lp_single") for f, n in CELLS])


def check(single: dict, got: dict, strategy: str) -> None:
    for fam, n in CELLS:
        ref, losses = single[f"{fam}{n}/lp_single"], got[f"{fam}{n}/{strategy}"]
        assert len(ref) == len(losses) == 8
        print(f"{fam} ({n} layers) {strategy} vs lp_single: largest relative loss difference "
              f"{max(abs(a - b) / abs(b) for a, b in zip(losses, ref)):.1e}")
        np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=f"{fam} under {strategy}")
        assert max(ref) - min(ref) > 1e-3  # the steps move the loss far beyond the tolerance


@pytest.mark.slow  # multi-process (the quick tier runs none)
def test_bert_and_roberta_train_under_lp_pipeline_as_on_one_device(single, tmp_path):
    check(single, run_script(tmp_path, 2, [(f, n, "lp_pipeline") for f, n in CELLS]), "lp_pipeline")


@pytest.mark.slow  # multi-process, 8 ranks
def test_bert_and_roberta_train_under_lp_3d_as_on_one_device(single, tmp_path):
    """pp=2 x tp=2 x dp=2 (FSDP) at 8 ranks: the derived pipeline plan with the derived tensor-parallel
    plan (``hf/tp_derive.py``; the tied word table and MLM decoder split by vocabulary on both stages)."""
    check(single, run_script(tmp_path, 8, [(f, n, "lp_3d") for f, n in CELLS]), "lp_3d")
