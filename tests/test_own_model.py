"""Bring your own model: a LightningModule written here, that lightning_par never saw, trained by a
plain ``lightning.Trainer`` in a user's own script (launched by Lightning as usual), under every
data-parallel strategy picked by its registry name; per-step losses equal the single-device run's.

The script holds no lightning_par code except ``import lightning_par.strategies`` (which registers
the ``lp_*`` names). Two models: ``Eager`` builds its layers in ``__init__`` (real tensors, same
seed on every rank); ``Deferred`` builds them in ``configure_model`` (on the meta device under
lightning_par's strategies, materialised by the strategy with the layers' own ``reset_parameters``
and seeded per init group, so its weights do not depend on the strategy). Neither declares a plan:
the FSDP / checkpointing units are found by the "repeated children" rule. Some tensors are set by
nothing but the constructor (a layer-scale gain, a shift made with ``torch.randn``, a constant
buffer): under meta-device init they must come out as the constructor made them.

One script run trains several strategies one after another in the same processes (Lightning
spawns the second rank once), so the whole module costs a few process starts.
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

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import lightning_par.strategies  # registers lp_ddp, lp_zero3, ...

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)
            self.gain = nn.Parameter(torch.full((d,), 0.5))  # layer scale: no reset_parameters sets it

        def forward(self, x):
            return x + self.gain * self.fc2(torch.tanh(self.fc1(self.norm(x))))

    class Stem(nn.Module):
        """Tensors made directly, as a ViT's cls token: nothing but the constructor sets them."""
        def __init__(self, d):
            super().__init__()
            self.shift = nn.Parameter(torch.randn(12) * 0.02)
            self.register_buffer("scale", torch.full((12,), 2.0))
            self.proj = nn.Linear(12, d)

        def forward(self, x):
            return self.proj((x + self.shift) * self.scale)

    def layers(d, n_classes):
        return nn.Sequential(Stem(d), *[Block(d) for _ in range(3)], nn.Linear(d, n_classes))

    class Eager(L.LightningModule):
        def __init__(self, d=32):
            super().__init__()
            self.body = layers(d, 5)

        def forward(self, x):
            return self.body(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Deferred(Eager):
        def __init__(self, d=32):
            L.LightningModule.__init__(self)
            self.d, self.body = d, None

        def configure_model(self):
            if self.body is None:
                self.body = layers(self.d, 5)

    class Losses(L.Callback):
        def __init__(self):
            self.values, self.init = [], {}

        def on_train_start(self, trainer, module):
            full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
            stem, gain = module.body[0], full(module.body[1].gain)
            self.init = {"scale": full(stem.scale).tolist(), "gain": sorted(set(gain.tolist())),
                         "shift_std": float(full(stem.shift).std()), "finite": all(
                             bool(full(p).isfinite().all()) for p in [*module.parameters(), *module.buffers()])}

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            # the global-batch mean: ranks hold equal slices, so the mean of their means
            self.values.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    def run(strategy, devices, model_cls, batch):
        L.seed_everything(0, verbose=False)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(256, 12, generator=g)
        y = (x @ torch.randn(12, 5, generator=g)).argmax(-1)  # a rule to learn
        data = TensorDataset(x, y)
        losses = Losses()
        trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=STEPS,
                            callbacks=[losses], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        try:
            trainer.fit(model_cls(), DataLoader(data, batch_size=batch, shuffle=False))
        except ValueError as e:  # a strategy's refusal: every rank raises it, and the script goes on
            return {"error": str(e)}
        return {"losses": losses.values, "init": losses.init}

    STEPS = 12
    out, devices, cells = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")  # cells: MODEL:STRATEGY
    models = {"eager": Eager, "deferred": Deferred}
    result = {cell: run(cell.split(":")[1], devices, models[cell.split(":")[0]], batch=16 // devices)
              for cell in cells}
    if int(__import__("os").environ.get("LOCAL_RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(result, f)
''')

DATA_PARALLEL = ["lp_ddp", "lp_zero1", "lp_zero2", "lp_zero3", "lp_zero3_offload", "lp_fsdp"]


def run_script(tmp_path: Path, devices: int, cells: list[tuple[str, str]], timeout: float = 600) -> dict:
    """One launch at ``devices`` ranks training every (model, strategy) cell in turn; results by cell."""
    script = tmp_path / "train_mine.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"losses_{devices}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = launch.run([sys.executable, str(script), str(out), str(devices), ",".join(f"{m}:{s}" for m, s in cells)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {tuple(k.split(":")): v for k, v in json.loads(out.read_text()).items()}


MODELS = ("eager", "deferred")


@pytest.fixture(scope="module")
def own_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """Both models under every strategy, one launch per world size (1, 2, 4). The reference is one device:
    Lightning shuffles a training set through its DistributedSampler under every multi-process strategy
    (seed 0), so the reference reads the same order: a data-parallel strategy on one device. Eager weights
    come from the module itself, so Lightning's own DDPStrategy is the reference; deferred weights come
    from lightning_par's init. At 2 ranks a strategy that refuses the model (no pipeline plan) comes first:
    the script catches it on every rank and goes on; the launcher once reaped Lightning's child ranks on
    any error, so every later fit failed."""
    tmp = tmp_path_factory.mktemp("own")
    return {1: run_script(tmp, 1, [("eager", "ddp"), ("deferred", "lp_ddp")]),
            2: run_script(tmp, 2, [(m, s) for m in MODELS for s in ["lp_pipeline", *DATA_PARALLEL]]),
            4: run_script(tmp, 4, [(m, s) for m in MODELS for s in ("lp_hsdp", "lp_zero3")])}


def assert_parity(got: list[float], ref: list[float], what: str) -> None:
    assert len(got) == len(ref) >= 10, (what, len(got), len(ref))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7, err_msg=what)


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("model", MODELS)
def test_own_lightning_module_every_data_parallel_strategy(own_runs: dict, model: str) -> None:
    ref_name = "ddp" if model == "eager" else "lp_ddp"
    ref_run = own_runs[1][(model, ref_name)]
    ref = ref_run["losses"]
    assert ref[-1] < ref[0]  # it learns
    two, four = own_runs[2], own_runs[4]
    refused = two[(model, "lp_pipeline")]
    assert "pipeline" in refused["error"] and "\n" not in refused["error"], refused
    runs = [(f"{n} x2", two[(model, n)]) for n in DATA_PARALLEL] + \
           [(f"{n} x4", four[(model, n)]) for n in ("lp_hsdp", "lp_zero3")]
    for what, got in [(f"{ref_name} x1", ref_run), *runs]:
        # what only the constructor set (deferred: replayed from its record, parallel/init/init_trace.py)
        init = got["init"]
        assert init["finite"] and init["scale"] == [2.0] * 12 and init["gain"] == [0.5], (model, what, init)
        assert 0.005 < init["shift_std"] < 0.04, (model, what, init)
    for what, got in runs:
        assert_parity(got["losses"], ref, f"{model} {what}")


MISUSE = textwrap.dedent('''
    import sys, torch, lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import lightning_par.strategies
    from lightning_par.parallel.contract import ParallelPlan

    class Three(L.LightningModule):
        """Declares a tensor-parallel plan, but has 3 heads: tp=2 cannot split them."""
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(6, 12), nn.Linear(12, 6)

        def parallel_plan(self):
            return ParallelPlan(tp_plan={"up": "colwise", "down": "rowwise"}, tp_divisible={"n_head": 3})

        def training_step(self, batch, batch_idx):
            return self.down(self.up(batch[0])).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = TensorDataset(torch.randn(8, 6))
    L.Trainer(strategy="lp_tensor_parallel", devices=2, accelerator="cpu", max_steps=2, logger=False,
              enable_progress_bar=False, enable_checkpointing=False).fit(Three(), DataLoader(data, batch_size=2))
''')


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plain_trainer_misuse_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "misuse.py"
    script.write_text(MISUSE)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = launch.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert errors == ["error: tensor-parallel degree tp=2 does not divide n_head=3; choose a tp that divides it"], \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_missing_declarations_are_one_line_each() -> None:
    """A plain module under a technique that needs a declaration: one line naming what to declare."""
    import torch
    from torch import nn

    from lightning_par.strategies import PipelineStrategy, TensorParallelStrategy

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    with torch.device("meta"):
        model = Plain()
    with pytest.raises(ValueError, match=r"^PipelineStrategy: pipeline parallelism needs to know where Plain may be "
                                         r"cut; declare parallel_plan\(\)\.layers") as e:
        PipelineStrategy().validate_setup(2, model)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^TensorParallelStrategy: tensor parallelism needs Plain's tensor-parallel "
                                         r"styles; declare parallel_plan\(\)\.tp_plan") as e:
        TensorParallelStrategy().validate_setup(2, model)
    assert "\n" not in str(e.value)


def test_units_rules_in_order() -> None:
    """The rule that chooses FSDP/checkpointing units, for a declared plan, repeated children and
    size; and init groups that do not depend on anything but the model."""
    import torch
    from torch import nn

    from lightning_par.parallel.contract import ParallelPlan
    from lightning_par.parallel.discovery import init_groups, resolve_plan

    class Repeated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(4, 8)
            self.small = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.big = nn.Sequential(*[nn.Linear(8, 32) for _ in range(3)])  # the largest: wins

    class Declared(Repeated):
        def parallel_plan(self) -> ParallelPlan:
            return ParallelPlan(blocks=("small.0", "small.1"))

    class Lumpy(nn.Module):  # no repeated children: size rule
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 8), nn.ReLU())

    with torch.device("meta"):  # shapes are all discovery needs
        r = resolve_plan(Repeated())
    assert (r.units_rule, r.plan.blocks) == ("repeated_children", ("big.0", "big.1", "big.2"))
    d = resolve_plan(Declared())
    assert (d.units_rule, d.plan.blocks) == ("declared", ("small.0", "small.1"))
    s = resolve_plan(Lumpy())
    assert s.units_rule == "size" and s.plan.blocks == ("a",)  # the only subtree with >= 1/8 of the parameters
    assert init_groups(Repeated(), r.plan.blocks) == ["big.0", "big.1", "big.2", "stem", "small.0", "small.1"]
