"""The memory model: the ZeRO paper's figures, lightning_par's byte layouts, activations, CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_par.estimate import (
    STRATEGIES,
    Shape,
    activation_bytes,
    bytes_per_param,
    estimate,
    estimate_all,
    estimate_table,
    main,
)
from lightning_par.models.gpt import PRESETS, GPTConfig


def _gb(x: float) -> float:
    return float(f"{x / 1e9:.3g}")  # 3 significant digits, GB = 1e9 bytes as in the paper


def test_zero_paper_figure_1() -> None:
    """Ψ = 7.5B, N = 64, K = 12 (Rajbhandari et al. 2020, Figure 1)."""
    got = {s: _gb(estimate(7.5e9, devices=64, strategy=s, precision="paper-mixed").total)
           for s in ("ddp", "zero1", "zero2", "zero3")}
    assert got == {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.88}
    assert bytes_per_param("paper-mixed", "adamw") == (2, 2, 12)


def test_stage_ordering_and_offload() -> None:
    rows = {r.strategy: r for r in estimate_all(1e9, devices=8, precision="bf16-mixed")}
    totals = [rows[s].total for s in ("ddp", "zero1", "zero2", "zero3")]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    assert rows["single"].as_dict() | {"strategy": "ddp"} == rows["ddp"].as_dict()  # same states per rank
    assert rows["fsdp"].total == rows["zero3"].total
    off = rows["zero3_offload"]
    assert (off.params, off.grads, off.optimizer_state, off.total) == (0, 0, 0, 0)
    assert off.offloaded == rows["zero3"].params + rows["zero3"].grads + rows["zero3"].optimizer_state
    # what each stage shards: zero1 only the optimizer state, zero2 also grads, zero3 also params
    assert rows["zero1"].params == rows["ddp"].params and rows["zero1"].grads == rows["ddp"].grads
    assert rows["zero2"].params == rows["ddp"].params and rows["zero2"].grads == rows["ddp"].grads // 8
    assert rows["zero3"].params == rows["ddp"].params // 8


def test_byte_layouts() -> None:
    # Lightning's bf16-mixed is autocast: fp32 params and grads, fp32 Adam m and v -> 16 bytes/param
    assert bytes_per_param("bf16-mixed", "adamw") == (4, 4, 8) == bytes_per_param("16-mixed", "adam")
    assert bytes_per_param("32-true", "sgd") == (4, 4, 4)
    assert bytes_per_param("bf16-true", "adamw") == (2, 2, 4)
    assert bytes_per_param("paper-mixed", "sgd") == (2, 2, 8)  # fp32 master + momentum
    r = estimate(1000, devices=4, strategy="ddp", precision="bf16-mixed")
    assert (r.params, r.grads, r.optimizer_state, r.activations) == (4000, 4000, 8000, 0)
    # sharded sizes are padded to a multiple of N: ceil(1001 / 4) = 251 elements
    assert estimate(1001, devices=4, strategy="zero3", precision="32-true").params == 251 * 4
    with pytest.raises(ValueError, match="unknown precision"):
        estimate(1000, devices=2, strategy="ddp", precision="fp8")
    with pytest.raises(ValueError, match="unknown strategy 'zero4'"):
        estimate(1000, devices=2, strategy="zero4")


def test_activation_formula() -> None:
    shape = Shape(n_layer=2, n_embd=64, n_head=4, vocab_size=256, seq_len=32)
    s, b, h, a, L = 32, 3, 64, 4, 2
    per_layer = s * b * h * (34 + 5 * a * s / h)  # Korthikanti et al. 2022, Eq. 1, 16-bit
    assert activation_bytes(shape, micro_batch_size=b, precision="bf16-mixed") == L * per_layer
    assert activation_bytes(shape, micro_batch_size=b, precision="32-true") == 2 * L * per_layer
    ckpt = activation_bytes(shape, micro_batch_size=b, precision="bf16-mixed", checkpointing=True)
    assert ckpt == L * 2 * s * b * h + per_layer
    # linear in batch, and checkpointing saves more the deeper the model
    deep = Shape(48, 1600, 25, 50304, 1024)
    assert activation_bytes(deep, micro_batch_size=4) == 4 * activation_bytes(deep, micro_batch_size=1)
    assert activation_bytes(deep, checkpointing=True) < activation_bytes(deep) / 10
    # a GPTConfig brings its own shape; a bare count has none
    cfg = GPTConfig(**PRESETS["gpt2"])
    r = estimate(cfg, devices=2, strategy="ddp", micro_batch_size=2)
    assert r.params == 4 * cfg.n_params
    assert r.activations == activation_bytes(Shape(12, 768, 12, 50304, 1024), micro_batch_size=2)
    assert r.total == r.params + r.grads + r.optimizer_state + r.activations
    assert estimate(cfg.n_params, devices=2, strategy="ddp").activations == 0


def test_table_marks_fit() -> None:
    table = estimate_table(7.5e9, devices=64, precision="paper-mixed", device_memory=32, unit="GB")
    lines = {line.split()[0]: line for line in table.splitlines()[3:]}
    assert list(lines) == list(STRATEGIES)
    assert "120.000" in lines["ddp"] and lines["ddp"].endswith("NO")
    assert lines["zero1"].endswith("yes") and lines["zero3"].endswith("yes")
    assert "31.406" in lines["zero1"] and "16.641" in lines["zero2"] and "1.875" in lines["zero3"]


def test_cli(capsys) -> None:
    main(["--model", "gpt2_xl", "--devices", "64", "--precision", "paper-mixed", "--device-memory", "80"])
    out = capsys.readouterr().out
    assert "N = 64" in out and "zero3_offload" in out and "fits 80 GiB" in out
    main(["--params", "7.5e9", "--devices", "64", "--precision", "paper-mixed", "--unit", "GB"])
    assert "120.000" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", "no_such_model", "--devices", "2"])
    assert "choose one of gpt_tiny" in capsys.readouterr().err
    done = subprocess.run([sys.executable, "-m", "lightning_par.estimate", "--params", "1e9", "--devices", "8"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "zero2" in done.stdout
