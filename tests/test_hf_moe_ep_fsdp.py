"""Every Hugging Face MoE family with an expert-parallel plan under ep x fsdp, through the strategy.

``tests/test_hf_moe_ep.py`` walks transformers' registry with the techniques alone (ep=2, gradients
averaged by hand). This walks the same families through what a user runs: a LightningModule written
here holding the family's tiny model (built in ``configure_model``, README case 2), trained 4 SGD steps
by a plain ``lightning.Trainer`` under ``lp_expert_parallel`` with ``data_parallel=fsdp`` at 2 ranks
(experts split over ep=2, everything else FSDP-sharded over the same ranks), against ``lp_single``.
Outcomes: **parity** (every step's loss within rtol 1e-5), **refused** (one line before the first
step), **unbuildable** (transformers cannot build or run the family at the tiny sizes, or its routing
samples in training, so two runs cannot agree), **failed** (anything else: the test fails).
One script run per world size holds every family (two process starts).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests import launch
from tests.test_hf_moe_ep import families_with_ep_plan

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import json, os, sys, warnings, logging
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    import torch.nn.functional as F
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import AutoModelForCausalLM
    import lightning_par.strategies  # registers lp_single, lp_expert_parallel, ...
    from lightning_par.strategies.expert_parallel import ExpertParallelStrategy
    from tests.test_hf_moe_ep import moe_tiny_config

    class LM(L.LightningModule):
        def __init__(self, config):
            super().__init__()
            self.config, self.net = config, None

        def configure_model(self):
            if self.net is None:
                self.net = AutoModelForCausalLM.from_config(self.config).float()

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.net(input_ids=x, use_cache=False).logits
            return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    class Losses(L.Callback):
        def __init__(self):
            self.values = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.values.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    def samples_in_training(config):  # routing that samples (PhiMoE's sparsemixer): two runs cannot agree
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
        ids = torch.arange(3, 35).reshape(2, 16)
        with torch.no_grad():
            return not torch.equal(*(model(input_ids=ids, use_cache=False).logits for _ in range(2)))

    def run(family, devices):
        try:
            config = moe_tiny_config(family)
            if devices == 1 and samples_in_training(config):
                return {"unbuildable": "routing samples in training"}
        except Exception as e:  # transformers' own refusal of the tiny sizes
            return {"unbuildable": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        L.seed_everything(0, verbose=False)
        g = torch.Generator().manual_seed(1)
        start, stride = torch.randint(0, 252, (32, 1), generator=g), torch.randint(1, 4, (32, 1), generator=g)
        ids = (start + stride * torch.arange(17)) % 252 + 4
        losses = Losses()
        strategy = "lp_single" if devices == 1 else ExpertParallelStrategy(data_parallel="fsdp")
        trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=4, callbacks=[losses],
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        data = TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
        try:  # the global batch is 8 sequences under both
            trainer.fit(LM(config), DataLoader(data, batch_size=8 // devices, shuffle=False))
        except ValueError as e:  # a refusal comes before the first step, on every rank alike
            text = str(e).strip()
            return {"error": f"{type(e).__name__}: {text.splitlines()[0] if text else ''}",
                    "lines": len(text.splitlines()), "losses": losses.values}
        return {"losses": losses.values}

    out, devices, families = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    result = {}
    for fam in families:
        try:
            result[fam] = run(fam, devices)
        except Exception as e:  # anything else: this family's failure (the other rank raises alike or is stopped)
            result[fam] = {"error": f"{type(e).__name__}: {str(e)[:200]}", "lines": 99, "losses": []}
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(result, f)
''')


def run_script(tmp_path: Path, devices: int, families: list[str]) -> dict:
    script = tmp_path / f"ep_fsdp_{devices}.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"families_{devices}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = launch.run([sys.executable, str(script), str(out), str(devices), json.dumps(families)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1000)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_moe_family_trains_under_ep_x_fsdp_or_is_refused_in_one_line(tmp_path: Path) -> None:
    families = families_with_ep_plan()
    ref = run_script(tmp_path, 1, families)
    usable = [f for f in families if "unbuildable" not in ref[f] and "error" not in ref[f]]
    two = run_script(tmp_path, 2, usable)
    outcome = {}
    for fam in families:
        if fam not in usable:
            outcome[fam] = ("unbuildable", ref[fam].get("unbuildable") or ref[fam].get("error"))
            continue
        got = two[fam]
        if "error" in got:
            kind = "refused" if not got["losses"] and got["lines"] == 1 else "failed"
            outcome[fam] = (kind, got["error"])
            continue
        try:
            np.testing.assert_allclose(got["losses"], ref[fam]["losses"], rtol=1e-5)
            outcome[fam] = ("parity", "")
        except AssertionError as e:
            outcome[fam] = ("failed", " ".join(str(e).split())[:200])
    for fam, (kind, why) in outcome.items():
        print(f"  {fam:28s} {kind:12s} {why[:150]}")
    counts = {k: sum(1 for v in outcome.values() if v[0] == k) for k in ("parity", "refused", "unbuildable", "failed")}
    print(counts)
    assert not {f: w for f, (k, w) in outcome.items() if k == "failed"}
    assert {f for f, (k, _) in outcome.items() if k == "parity"} >= {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3",
                                                                   "gpt_oss", "olmoe", "jamba"}
