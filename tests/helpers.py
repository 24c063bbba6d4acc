"""Helpers for end-to-end tests: run ``run.py`` (forked as a command would run, ``tests/launch.py``) with a time
limit and read its summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from tests import launch

ROOT = Path(__file__).resolve().parents[1]

# A run of a few seconds: tiny GPT, 12 steps, no validation, no progress bar.
QUICK = ["experiment=quick", "trainer.max_steps=12", "trainer.limit_val_batches=0",
         "trainer.enable_progress_bar=false"]


def composed(*overrides: str, tmp: Path | None = None):
    """The app's config (``pkg://lightning_par.conf``) composed in-process with ``overrides``, with the
    Hydra config set as in a real run; ``tmp``: the run's output directory."""
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_par.conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # so ${hydra:...} resolves as in a real run
    if tmp is not None:
        with open_dict(cfg):
            cfg.paths.output_dir = str(tmp)
    return cfg


def run_cli(args: list[str], run_dir: Path, timeout: float = 240, check: bool = True,
            fork: bool = True) -> subprocess.CompletedProcess:
    """``python run.py *args`` with its output captured; forked from the tests' server (``tests/launch.py``)
    unless ``fork`` is false (a test of how processes start needs a real command)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    cmd = [sys.executable, str(ROOT / "run.py"), *args]
    if not any(a.startswith("-m") or a == "--multirun" for a in args):
        cmd.append(f"hydra.run.dir={run_dir}")
    run = launch.run if fork else subprocess.run
    proc = run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"run.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc


def train_summary(args: list[str], run_dir: Path, timeout: float = 240) -> dict:
    run_cli(args, run_dir, timeout)
    with open(run_dir / "summary.json") as f:
        return json.load(f)


def assert_losses_match(got: dict, ref: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    a, b = np.asarray(got["losses"]), np.asarray(ref["losses"])
    assert len(a) == len(b) >= 10, (len(a), len(b))
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol,
                               err_msg=f"{got['strategy']} x{got['world_size']} vs {ref['strategy']}")


def memtracker_step_peak(net: torch.nn.Module, vocab_size: int, batch: int, seq: int, precision: str) -> int:
    """torch MemTracker's peak (bytes, CPU) over one training step of ``net`` -- the demo models'
    ``loss_fn`` plus the MoE layers' auxiliary losses if it has them, the optimizer factory's AdamW,
    autocast for bf16-mixed -- after a warm-up step, so the optimizer state exists as in every step
    but the first."""
    from contextlib import nullcontext

    from lightning_par.models.module import cross_entropy
    from lightning_par.core.optim import OptimizerConfig, build_optimizer

    opt = build_optimizer(net.parameters(), OptimizerConfig("adamw", lr=1e-3))
    x = torch.randint(0, vocab_size, (batch, seq))
    y = torch.randint(0, vocab_size, (batch, seq))
    aux_loss = getattr(net, "aux_loss", lambda: None)

    def step() -> None:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()
        with ctx:
            loss = cross_entropy(net(x), y)
            aux = aux_loss()
            if aux is not None:
                loss = loss + aux
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return steady_step_peak(step, net, opt)


def steady_step_peak(step, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """torch MemTracker's peak (bytes, every device) over ``step()`` run a second time: the first
    creates the optimizer's states, as every step after the first holds them."""
    from torch.distributed._tools.mem_tracker import MemTracker

    step()
    tracker = MemTracker()
    tracker.track_external(module, optimizer)
    with tracker:
        step()
    return int(sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values()))


#: registry walks: a family whose tiny config keeps a part at full size is not built
TINY_MAX_PARAMS = 5_000_000


def tiny_causal_lm(model_type: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The family's causal LM at ``registry.tiny_config`` sizes without dropout (two copies must compute alike):
    (a meta-device copy, a seeded fp32 copy on CPU). ``ValueError`` for a family over ``TINY_MAX_PARAMS``;
    transformers' own exceptions for sizes it refuses (the walks count both as unbuildable)."""
    from transformers import AutoModelForCausalLM

    from lightning_par.models.hf.registry import tiny_config

    config = tiny_config(model_type)
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    if sum(p.numel() for p in meta.parameters()) > TINY_MAX_PARAMS:
        raise ValueError("a part at full size")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return meta, model


def saved_bytes_of_layer(net: torch.nn.Module, layer: torch.nn.Module, x: torch.Tensor, precision: str) -> int:
    """Bytes of the tensors autograd first saves inside ``layer`` during a forward and cross-entropy of ``net``
    on tokens ``x`` (each storage once; parameters and what earlier layers saved -- RoPE's shared cos/sin --
    left out, autocast's weight copies in), counted with ``saved_tensors_hooks``. A QLoRA model's NF4 weights
    (torchao's subclass: their inner storages are parameters too, and its matmul saves the weight itself) count
    as parameters."""
    from contextlib import nullcontext

    from lightning_par.callbacks.memory import stored_tensors
    from lightning_par.models.module import cross_entropy

    params = {t.untyped_storage().data_ptr() for t in stored_tensors(net.parameters())}
    seen: dict[int, tuple[bool, int]] = {}  # storage -> (first saved inside the layer, bytes)
    inside = [False]
    hooks = [layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
             layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if type(t).__name__ == "NF4Tensor":  # a frozen 4-bit weight (a parameter; it has no storage of its own)
            return t
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), (inside[0], storage.nbytes()))
        return t

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
            cross_entropy(net(x), x)
    finally:
        for hook in hooks:
            hook.remove()
    return sum(n for mine, n in seen.values() if mine)
