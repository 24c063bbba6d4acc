"""One dtype table (``lightning_par/core/dtypes.py``): names <-> torch dtypes <-> bytes, Lightning precision
strings -> (parameter dtype, compute dtype), and the two bugs its duplicates caused: the throughput
monitor reading FSDP's ``param_dtype`` as fp32 (MFU against the fp32 peak), and ``mode=estimate``
pricing FSDP's bf16 all-gathers at fp32 (issue 21)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# ----------------------------------------------------------------------------------- the table


def test_names_bytes_and_precisions() -> None:
    from lightning_par.core import dtypes as D

    spellings = {torch.bfloat16: ("bf16", "bfloat16", "torch.bfloat16", "BF16"),
                 torch.float16: ("fp16", "float16", "half", "torch.float16", "torch.half"),
                 torch.float32: ("fp32", "float32", "float", "torch.float32", "torch.float"),
                 torch.float64: ("fp64", "float64", "double", "torch.float64")}
    for dtype, names in spellings.items():
        for name in names:
            assert D.to_dtype(name) is dtype, name
        assert D.to_dtype(dtype) is dtype
        assert D.dtype_bytes(dtype) == D.dtype_bytes(names[0]) == dtype.itemsize
    assert D.short_name(torch.bfloat16) == "bf16" and D.short_name(torch.float32) == "fp32"
    assert D.short_name(torch.int64) is None
    assert D.parse_dtype(None, "param_dtype") is None and D.parse_dtype("bf16", "param_dtype") is torch.bfloat16
    with pytest.raises(ValueError, match=r"^unknown param_dtype 'fp8'; choose one of bf16, fp16, fp32") as e:
        D.parse_dtype("fp8", "param_dtype")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        D.dtype_bytes("int4")

    f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
    expected = {"32-true": (f32, f32), "bf16-mixed": (f32, bf16), "16-mixed": (f32, f16), "bf16-true": (bf16, bf16),
                "16-true": (f16, f16), "64-true": (f64, f64), "transformer-engine": (bf16, bf16),
                "transformer-engine-float16": (f16, f16),
                # Lightning's short forms
                "32": (f32, f32), "bf16": (f32, bf16), "16": (f32, f16), "64": (f64, f64), 32: (f32, f32)}
    for precision, (param, compute) in expected.items():
        p = D.precision(precision)
        assert (p.param, p.compute) == (param, compute), precision
        assert p.autocast == (param != compute)
    import typing

    from lightning.fabric.connector import _PRECISION_INPUT

    lightning = [v for lit in typing.get_args(_PRECISION_INPUT) for v in typing.get_args(lit)]
    assert len(lightning) > 10 and all(D.precision(v) for v in lightning)  # every precision Lightning accepts
    assert D.canonical_precision("bf16") == "bf16-mixed" and D.canonical_precision("32-true") == "32-true"
    assert D.precision("paper-mixed").master is torch.float32  # the ZeRO paper's fp16 + fp32 master copy
    with pytest.raises(ValueError, match=r"^unknown precision 'fp8-mixed'; choose one of "):
        D.precision("fp8-mixed")


def test_the_estimators_tables_come_from_it() -> None:
    """The bytes the cost model uses are the table's (unchanged figures)."""
    from lightning_par.costs.activations import dtypes as act_dtypes
    from lightning_par.costs.states import bytes_per_param

    assert bytes_per_param("32-true") == (4, 4, 8) and bytes_per_param("bf16-mixed") == (4, 4, 8)
    assert bytes_per_param("bf16-true") == (2, 2, 4) and bytes_per_param("paper-mixed") == (2, 2, 12)
    assert act_dtypes("32-true") == (4, 4, False) and act_dtypes("bf16-mixed") == (2, 4, True)
    assert act_dtypes("16-mixed") == (2, 4, True) and act_dtypes("bf16-true") == (2, 2, False)
    assert act_dtypes("paper-mixed") == (2, 2, False)


# ------------------------------------------------- bug 1: MFU against the param_dtype's peak

H100 = "NVIDIA H100 80GB HBM3"


def _fit_start(monkeypatch, strategy, precision: str = "32-true"):
    """ThroughputMonitor.on_fit_start on a (pretend) H100, no process started, no CUDA touched."""
    from lightning_par.callbacks.throughput import ThroughputMonitor

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    trainer = SimpleNamespace(strategy=strategy, precision=precision, datamodule=None, world_size=2, global_step=0)
    cb = ThroughputMonitor()
    cb.on_fit_start(trainer, SimpleNamespace(device=torch.device("cuda", 0)))
    return cb


@pytest.mark.parametrize("param_dtype", ["bf16", "bfloat16", "torch.bfloat16", torch.bfloat16])
def test_mfu_peak_follows_fsdp_param_dtype(monkeypatch, param_dtype) -> None:
    """``strategy=fsdp strategy.param_dtype=bf16`` under ``trainer.precision=32-true``: the matmuls run in
    bf16, so MFU divides by the bf16 peak (989 TFLOP/s on an H100 SXM), not fp32's 66.9 (or tf32's)."""
    from lightning_par.strategies.fsdp import FSDPStrategy

    cb = _fit_start(monkeypatch, FSDPStrategy(param_dtype=param_dtype))
    assert cb.matmul_dtype == torch.bfloat16
    assert cb.peak_flops_per_rank == pytest.approx(989e12)


@pytest.mark.parametrize("param_dtype", ["fp16", "float16", "half"])
def test_mfu_peak_follows_fsdp_param_dtype_fp16(monkeypatch, param_dtype) -> None:
    from lightning_par.strategies.fsdp import FSDPStrategy

    cb = _fit_start(monkeypatch, FSDPStrategy(param_dtype=param_dtype))
    assert cb.matmul_dtype == torch.float16


@pytest.mark.parametrize("precision,dtype", [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16),
                                             ("bf16-true", torch.bfloat16), ("16-mixed", torch.float16),
                                             ("transformer-engine", torch.bfloat16)])
def test_mfu_peak_follows_the_trainer_precision(monkeypatch, precision, dtype) -> None:
    from lightning_par.strategies.fsdp import FSDPStrategy

    cb = _fit_start(monkeypatch, FSDPStrategy(), precision)
    assert cb.matmul_dtype == dtype


# -------------------------------------------- bug 2: mode=estimate prices bf16 gathers at 2 bytes


def _estimate(tmp_path: Path, *overrides: str) -> dict:
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from lightning_par.modes.estimate import run_estimate

    GlobalHydra.instance().clear()
    with initialize_config_module("lightning_par.conf", version_base="1.3"):
        cfg = compose("config", overrides=["mode=estimate", "model=gpt2", "strategy=fsdp", "trainer.devices=2",
                                           f"paths.output_dir={tmp_path}", *overrides])
    run_estimate(cfg)
    record = json.loads((tmp_path / "estimate.json").read_text())
    return {r["strategy"]: r for r in record["strategies"]}


def test_estimate_prices_fsdp_bf16_gathers(tmp_path: Path) -> None:
    """gpt2 over 2 ranks, fsdp, 32-true, seq 128. In fp32 the peak falls at the head's backward, when
    the root (embeddings and the untied head) is gathered again; with ``param_dtype=bf16`` the gathers
    move 2 bytes per parameter and the forward computes in bf16, so the activations shrink too, and
    the peak falls at the loss. The states (fp32 shards) do not move. Absolute figures are checked
    against FSDPMemTracker in tests/test_fsdp_peak.py (within 7%); the figures here are today's (a CUDA
    estimate: cuBLAS's two 32 MiB workspaces included, costs/peak.py)."""
    fp32 = _estimate(tmp_path / "fp32")["fsdp"]
    bf16 = _estimate(tmp_path / "bf16", "strategy.param_dtype=bf16")["fsdp"]
    assert (fp32["moment"], bf16["moment"]) == ("backward head", "backward loss")
    assert (fp32["peak"], bf16["peak"]) == (2_487_331_840, 1_969_847_296)
    assert bf16["activations"] < 0.7 * fp32["activations"]
    for key in ("params", "grads", "optimizer_state"):  # the shards stay fp32
        assert bf16[key] == fp32[key], key
    assert _estimate(tmp_path / "same", "strategy.param_dtype=fp32")["fsdp"]["transient"] == fp32["transient"]
    assert _estimate(tmp_path / "long", "strategy.param_dtype=bfloat16")["fsdp"]["transient"] == bf16["transient"]
