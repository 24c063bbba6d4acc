"""The strategy catalogue (``lightning_par/strategies/catalog.py``): every strategy declared once, and
everything else derived from it -- Lightning's registry, the yaml defaults, ``mode=estimate``, the
comm model, the advisor. The last test follows docs/architecture.md's "Add a strategy" with a toy
strategy on a copy of the package, touching three files, and shows every consumer picks it up and
that it trains like one device."""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.strategies import StrategyRegistry

import lightning_par.strategies  # noqa: F401 -- registers the strategies
from tests.helpers import QUICK, ROOT, assert_losses_match
from lightning_par.costs.comm import TRAFFIC_MODELS, CommShape, step_comm_bytes
from lightning_par.costs.shape import Shape
from lightning_par.strategies.catalog import CATALOG, entry, entry_of

CONF = ROOT / "lightning_par/conf/strategy"


def _yaml(name: str) -> dict:
    return yaml.safe_load((CONF / f"{name}.yaml").read_text())


def _target_class(target: str) -> type:
    module, _, cls = target.rpartition(".")
    return getattr(importlib.import_module(module), cls)


def test_every_yaml_is_one_entry_and_says_its_defaults() -> None:
    assert {p.stem for p in CONF.glob("*.yaml")} == {e.name for e in CATALOG}
    for e in CATALOG:
        cfg, defaults = _yaml(e.name), e.defaults()
        if "defaults" in cfg:  # a preset: its parent's yaml with the preset's arguments over it
            (parent,) = cfg.pop("defaults")
            cfg = {**_yaml(parent), **cfg}
        assert _target_class(cfg.pop("_target_")) is e.strategy_class(), e.name
        for key, value in cfg.items():
            assert key in defaults, f"{e.yaml}: {key} is not an argument of {e.target}"
            assert value == defaults[key] or (value is None and defaults[key] is None), \
                f"{e.yaml}: {key}={value!r}, but the constructor's default is {defaults[key]!r}"


def test_registry_built_instances_and_meshes_follow_the_catalogue() -> None:
    for e in CATALOG:
        registered = StrategyRegistry[e.registry_name]
        assert registered["strategy"] is e.strategy_class() and registered["init_params"] == dict(e.preset), e.name
        strategy = e.strategy_class()(**e.preset)
        assert entry_of(strategy) is e, e.name  # hsdp is told apart from fsdp by its preset
        assert e.comm in TRAFFIC_MODELS, e.name
        for world in (1, 2, 4, 8):
            try:
                dims = strategy.dims_for(world)
            except ValueError:  # a world this strategy's defaults cannot split (tp=2 x pp=2 on 2 ranks)
                continue
            used = {axis for axis, size in dims.sizes().items() if size > 1}
            assert used <= set(e.axes), (e.name, world, used)
            layout = e.cost_layout(world) if world in (4, 8) and e.name != "expert_parallel" else None
            if layout is not None:  # the priced mesh is the built one
                assert {k: v for k, v in layout.mesh.items() if v > 1} == \
                    {k: v for k, v in dims.sizes().items() if v > 1}, (e.name, world)
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        entry("nope")


def test_comm_model_dispatches_on_the_catalogue() -> None:
    shape = CommShape(shape=Shape(n_layer=2, n_embd=8, n_head=1, vocab_size=16, seq_len=4), micro_batch=1)
    # zero3, zero3_offload, fsdp and hsdp name one traffic model: the same bytes on the same mesh
    fsdp = [step_comm_bytes(e.name, n_params=100, mesh={"dp_shard": 4}, shape=shape) for e in CATALOG if e.comm == "fsdp"]
    assert len(fsdp) == 4 and all(c == fsdp[0] for c in fsdp) and fsdp[0]["all_gather"]["dp_shard"] == 800
    with pytest.raises(ValueError, match="no communication model for strategy 'nope'"):
        step_comm_bytes("nope", n_params=1, mesh={})


# ----------------------------------------------------------------------------------- add a strategy
TOY_CLASS = '''"""toy: FSDP that keeps the gathered parameters from forward to backward."""

from lightning_par.strategies.fsdp import FSDPStrategy


class ToyStrategy(FSDPStrategy):
    strategy_name = "lp_toy"

    def __init__(self, activation_checkpointing: bool = False, process_group_backend: str | None = None) -> None:
        super().__init__(reshard_after_forward=False, activation_checkpointing=activation_checkpointing,
                         process_group_backend=process_group_backend)
'''
TOY_YAML = '''_target_: lightning_par.strategies.toy.ToyStrategy
activation_checkpointing: false
process_group_backend: null
'''
TOY_ENTRY = '''    StrategyEntry("toy", f"{_S}.toy:ToyStrategy", "FSDP, parameters kept gathered until backward", ("dp_shard",),
                  FULLY_SHARDED, "fsdp", advise=_many_devices, preference=5),
'''


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".yaml")}


@pytest.mark.timeout(600)
def test_a_new_strategy_is_one_entry_one_class_one_yaml(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "lightning_par", tmp_path / "lightning_par",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "run.py", tmp_path / "run.py")
    before = _files(tmp_path / "lightning_par")
    pkg = tmp_path / "lightning_par"
    # the three steps of docs/architecture.md, "Add a strategy"
    (pkg / "strategies/toy.py").write_text(TOY_CLASS)
    (pkg / "conf/strategy/toy.yaml").write_text(TOY_YAML)
    catalog = (pkg / "strategies/catalog.py").read_text()
    start = catalog.index("CATALOG: tuple[StrategyEntry, ...] = (")
    end = catalog.index("\n)\n", start)
    (pkg / "strategies/catalog.py").write_text(catalog[:end + 1] + TOY_ENTRY + catalog[end + 1:])
    after = _files(pkg)
    changed = {k for k in after if before.get(k) != after[k]}
    assert changed == {"strategies/toy.py", "conf/strategy/toy.yaml", "strategies/catalog.py"}, changed

    # the registry, the estimator, the comm model and the advisor know it; then it trains the model one device
    # trains. The five commands run one after another in one interpreter (tests/serial.py: each as its command
    # runs it), with the copy first on the path
    (tmp_path / "probe.py").write_text("""
import json, lightning_par, lightning_par.strategies
from lightning.pytorch.strategies import StrategyRegistry
from lightning_par.costs.comm import step_comm_bytes
from lightning_par.costs.estimate import estimate
print(json.dumps({"file": lightning_par.__file__, "registered": StrategyRegistry["lp_toy"]["strategy"].__name__,
                  "comm": step_comm_bytes("toy", n_params=1000, mesh={"dp_shard": 4}),
                  "peak": estimate(10**9, devices=4, strategy="toy", precision="32-true").peak,
                  "ddp_peak": estimate(10**9, devices=4, strategy="ddp", precision="32-true").peak}))
""")
    from tests import serial

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(tmp_path))
    done = serial.run({
        "probe": [],
        "advice": ["--model", "gpt2", "--devices-per-node", "4"],
        "estimate": ["mode=estimate", "model=gpt2", "strategy=toy", "trainer.devices=4", f"hydra.run.dir={tmp_path / 'estimate'}"],
        **{strategy: [*QUICK, f"strategy={strategy}", f"trainer.devices={devices}", f"hydra.run.dir={tmp_path / strategy}"]
           for strategy, devices in (("single", 1), ("toy", 2))},
    }, tmp_path / "output", script=tmp_path / "run.py", env=env, cwd=tmp_path, timeout=600,
        programs={"probe": tmp_path / "probe.py", "advice": "-m lightning_par.modes.advise"})
    got = json.loads(done["probe"].check().stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(tmp_path)) and got["registered"] == "ToyStrategy"
    assert got["comm"] == {"all_gather": {"dp_shard": 8000}, "reduce_scatter": {"dp_shard": 4000}}
    assert got["peak"] < got["ddp_peak"] / 3  # everything sharded over 4 ranks
    advice = done["advice"].check()
    assert any(line.startswith("toy ") for line in advice.stdout.splitlines()), advice.stdout
    estimate_run = done["estimate"].check()
    assert any(line.startswith("toy ") for line in estimate_run.stdout.splitlines()), estimate_run.stdout

    # and it trains the model one device trains (fp32, gloo; rtol 1e-5 on every one of 12 steps)
    runs = {}
    for strategy in ("single", "toy"):
        done[strategy].check()
        runs[strategy] = json.loads((tmp_path / strategy / "summary.json").read_text())
    assert runs["toy"]["strategy"] == "toy" and runs["toy"]["world_size"] == 2
    assert_losses_match(runs["toy"], runs["single"])


def test_estimate_names_a_preset_by_its_entry(tmp_path: Path) -> None:
    """``mode=estimate strategy=hsdp`` labelled its row ``fsdp`` (the class's name) and dropped the
    plain fsdp row; the catalogue tells the preset apart."""
    from tests.helpers import composed
    from lightning_par.modes.estimate import run_estimate

    run_estimate(composed("mode=estimate", "model=gpt2", "strategy=hsdp", "trainer.devices=4", tmp=tmp_path))
    record = json.loads((tmp_path / "estimate.json").read_text())
    rows = {r["strategy"]: r for r in record["strategies"]}
    assert record["strategy"] == "hsdp" and {"fsdp", "hsdp"} <= set(rows)
    assert rows["hsdp"]["mesh"] == {"dp_replicate": 2, "dp_shard": 2} and rows["fsdp"]["mesh"] == {"dp_shard": 4}
