"""A batch the pipeline (or loss-parallel TP) cannot pass on whole is refused in one line, not unpacked
into something else: these strategies call the model's forward and loss_fn themselves, so a padding
mask or other field of the batch would otherwise be dropped without a word. Where the stages run a
Hugging Face model's own forward, a dict batch's fields (attention_mask, token_type_ids, ...) reach
every stage for its micro-batch."""

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_par.strategies.pipeline_loop import input_and_target, pipeline_inputs


def test_an_input_target_pair_passes_through():
    x, y = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)
    for batch in ((x, y), [x, y]):
        got = input_and_target(batch, "the pipeline")
        assert got[0] is x and got[1] is y


@pytest.mark.parametrize("batch, shape", [
    ({"input_ids": torch.zeros(2, 4), "labels": torch.zeros(2, 4)}, "a dict with keys ['input_ids', 'labels']"),
    ((torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4)), "a tuple of 3"),
    ((torch.zeros(2, 4), [1, 2]), "a tuple of 2"),
    (torch.zeros(2, 4), "a Tensor"),
])
def test_anything_else_is_one_line_naming_what_came(batch, shape):
    with pytest.raises(ValueError) as e:
        input_and_target(batch, "the pipeline")
    msg = str(e.value)
    assert "\n" not in msg and shape in msg and "(input, target) pair" in msg, msg


def test_a_dict_batch_passes_its_fields_where_the_stages_run_the_models_forward():
    ids, mask = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)
    x, y, extras = pipeline_inputs({"input_ids": ids, "labels": ids, "attention_mask": mask}, "the pipeline",
                                   forward_kwargs=True)
    assert x is ids and y is ids and extras == {"attention_mask": mask}
    with pytest.raises(ValueError, match=r"^the pipeline: every field of a dict batch must be a tensor of the batch's "
                                         r"size \(2 rows\); position_ids is not$"):
        pipeline_inputs({"input_ids": ids, "labels": ids, "position_ids": torch.zeros(3, 4)}, "the pipeline",
                        forward_kwargs=True)
    with pytest.raises(ValueError, match="a dict with keys"):  # no labels: not a batch the pipeline can run
        pipeline_inputs({"input_ids": ids, "attention_mask": mask}, "the pipeline", forward_kwargs=True)


# ---------------------------------------------------------------------------------------------
# A Hugging Face model's padded batches through the pipeline: the mask reaches every stage

MASKED = textwrap.dedent('''
    import json, sys, warnings, logging
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    import torch.nn.functional as F
    import lightning as L
    from torch.utils.data import DataLoader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM
    import lightning_par.strategies  # registers lp_pipeline, ...

    SMALL = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, vocab_size=256,
                 max_position_embeddings=64, pad_token_id=0)
    FAMILIES = {"llama": (AutoModelForCausalLM, dict(num_key_value_heads=2, head_dim=16)),
                "bert": (AutoModelForMaskedLM, dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))}

    class LM(L.LightningModule):  # a user's module: the batch is a dict, the HF way
        def __init__(self, family, use_mask=True):
            super().__init__()
            self.family, self.use_mask, self.net = family, use_mask, None

        def configure_model(self):
            if self.net is None:
                cls, extra = FAMILIES[self.family]
                torch.manual_seed(0)
                cfg = AutoConfig.for_model(self.family, **SMALL, **extra)
                cfg._attn_implementation = "eager"
                self.net = cls.from_config(cfg)

        def loss_fn(self, logits, target):  # the pipeline's last stage calls it, once per micro-batch
            # summed over the labelled tokens, over a count that does not depend on the rows: a mean per
            # micro-batch would weigh a token by its micro-batch's count of labels (padding differs by row)
            return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100,
                                   reduction="sum") / target.numel()

        def training_step(self, batch, batch_idx):
            fields = {k: v for k, v in batch.items() if k != "labels" and (self.use_mask or k == "input_ids")}
            return self.loss_fn(self.net(**fields).logits, batch["labels"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    def rows(family):
        g = torch.Generator().manual_seed(1)
        out = []
        for i in range(16):
            ids = torch.randint(5, 256, (16,), generator=g)
            n = 6 + (i * 5) % 11  # 6..16 real tokens, the rest padding
            mask = (torch.arange(16) < n).long()
            if family == "llama":  # left padding (real tokens would attend to it unmasked); targets: the next token
                mask = mask.flip(0)
                labels = torch.where(mask.bool(), torch.roll(ids, -1), torch.full_like(ids, -100))
                labels[-1] = -100
                out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
            else:  # masked LM: every third real token masked; two segments
                labels = torch.full_like(ids, -100)
                pick = (torch.arange(16) % 3 == 0) & mask.bool()
                labels[pick] = ids[pick]
                out.append({"input_ids": torch.where(pick, torch.full_like(ids, 4), ids) * mask, "attention_mask": mask,
                            "token_type_ids": (torch.arange(16) >= n // 2).long() * mask, "labels": labels})
        return out

    class Losses(L.Callback):
        def __init__(self):
            self.values = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.values.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    out, devices, cells = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    result = {}
    for family, strategy, use_mask in cells:
        L.seed_everything(0, verbose=False)
        losses = Losses()
        trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=6, callbacks=[losses],
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(LM(family, use_mask), DataLoader(rows(family), batch_size=8, shuffle=False))
        result[f"{family}/{strategy}/{use_mask}"] = losses.values
    if trainer.is_global_zero:
        with open(out, "w") as f:
            json.dump(result, f)
''')


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_padding_mask_reaches_every_pipeline_stage(tmp_path: Path) -> None:
    """A Llama (causal, left padding) and a BERT (masked LM, padding and two segments' token_type_ids),
    trained by a LightningModule on dict batches, the Hugging Face way (the loss summed over the labelled
    tokens and divided by the tokens of the batch, so that micro-batches add up to it: a mean over each
    micro-batch's labels would weigh the rows otherwise): under lp_pipeline at 2 ranks (2
    micro-batches of 4) the batch's attention_mask and token_type_ids reach each stage's forward of the
    model for its micro-batch, and the 6 steps' losses equal lp_single's (rtol 1e-5). Without the mask
    the losses differ (by more than 1e-3), so the comparison can tell."""
    import json

    from tests.test_pretrained import _run

    got = {}
    for devices, cells in ((1, [[f, "lp_single", m] for f in ("llama", "bert") for m in (True, False)]),
                           (2, [[f, "lp_pipeline", True] for f in ("llama", "bert")])):
        out = tmp_path / f"losses_{devices}.json"
        _run(MASKED, str(out), str(devices), json.dumps(cells), cwd=tmp_path, timeout=600)
        got.update(json.loads(out.read_text()))
    for family in ("llama", "bert"):
        single, pipe, unmasked = (got[f"{family}/{s}/{m}"] for s, m in (("lp_single", True), ("lp_pipeline", True),
                                                                       ("lp_single", False)))
        print(f"  {family}: single {single}\n  {family}: pipeline {pipe}")
        assert len(single) == len(pipe) == 6 and max(single) - min(single) > 1e-3, (single, pipe)
        np.testing.assert_allclose(pipe, single, rtol=1e-5, err_msg=family)
        assert max(abs(a - b) for a, b in zip(single, unmasked)) > 1e-3, (family, single, unmasked)
