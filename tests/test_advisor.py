"""The advisor follows the decision tree, with memory figures from the estimator."""

from __future__ import annotations

import subprocess
import sys

from lightning_par.advisor import Cluster, advise, largest_layer_params
from lightning_par.estimate import GIB, Shape, estimate, model_shape


def test_125m_on_one_24gb_gpu_is_single():
    shape = Shape(n_layer=12, n_embd=768, n_head=12, vocab_size=50304, seq_len=1024)
    a = advise(125_000_000, shape, Cluster(nodes=1, devices_per_node=1, device_memory_gb=24))
    assert a.strategy == "single" and a.overrides == []
    assert a.per_device_bytes == estimate(125_000_000, devices=1, strategy="single", shape=shape,
                                          checkpointing=True).total
    assert a.command("gpt2") == "python run.py strategy=single model=gpt2"


def test_125m_on_8_gpus_is_ddp():
    shape = Shape(12, 768, 12, 50304, 1024)
    a = advise(125_000_000, shape, Cluster(1, 8, 80))
    assert a.strategy == "ddp" and "trainer.devices=8" in a.overrides


def test_7b_on_8x80gb_shards_data_parallel_states():
    n, shape = model_shape("gpt_7b")
    a = advise(n, shape, Cluster(1, 8, 80))
    whole = estimate(n, devices=1, strategy="single", shape=shape, checkpointing=True)
    assert whole.total > 80 * GIB  # does not fit one device: the tree leaves plain DP
    assert a.strategy in ("zero1", "zero2", "fsdp")
    assert a.per_device_bytes == estimate(n, devices=8, strategy=a.strategy, shape=shape, checkpointing=True).total
    assert a.per_device_bytes <= 0.9 * 80 * GIB
    assert "model=gpt_7b" in a.command("gpt_7b") and "trainer.devices=8" in a.command("gpt_7b")


def test_70b_on_4_nodes_slow_links_cuts_the_model():
    shape = Shape(n_layer=80, n_embd=8192, n_head=64, vocab_size=32000, seq_len=2048)
    a = advise(70_000_000_000, shape, Cluster(nodes=4, devices_per_node=8, device_memory_gb=80, slow_inter_node=True))
    # sharding within one node (8 ranks) cannot hold 70B x 16 bytes, and slow links rule out a 32-way shard
    assert estimate(70_000_000_000, devices=8, strategy="fsdp", shape=shape, checkpointing=True).total > 72 * GIB
    assert a.strategy == "3d" and a.mesh == {"pp": 4, "tp": 8}
    assert {"strategy.tp=8", "strategy.pp=4", "trainer.num_nodes=4"} <= set(a.overrides)
    assert a.per_device_bytes < 72 * GIB


def test_same_70b_with_fast_links_shards_over_everything():
    shape = Shape(80, 8192, 64, 32000, 2048)
    a = advise(70_000_000_000, shape, Cluster(nodes=4, devices_per_node=8, device_memory_gb=80))
    assert a.strategy == "fsdp"


def test_largest_layer_beyond_one_device_needs_tensor_parallel():
    # a 2M-token vocabulary at width 8192: one 16.4B-parameter table, 122 GiB with its gradient
    shape = Shape(n_layer=24, n_embd=8192, n_head=64, vocab_size=2_000_000, seq_len=2048)
    assert largest_layer_params(shape) * 8 > 80 * GIB
    a = advise(40_000_000_000, shape, Cluster(1, 8, 80))
    assert a.strategy == "tensor_parallel" and a.mesh == {"tp": 8}


def test_one_small_device_offloads():
    shape = Shape(32, 4096, 32, 32000, 2048)
    a = advise(6_700_000_000, shape, Cluster(1, 1, 24))
    assert a.strategy == "zero3_offload"


def test_cli_prints_the_recommendation_and_its_command():
    out = subprocess.run([sys.executable, "-m", "lightning_par.advisor", "--model", "gpt_7b", "--devices-per-node",
                          "8", "--device-memory", "80"], capture_output=True, text=True, timeout=60, check=True).stdout
    n, shape = model_shape("gpt_7b")
    expected = advise(n, shape, Cluster(1, 8, 80))
    lines = out.splitlines()
    assert lines[0] == f"Recommended: {expected.strategy}", lines[0]  # the decision itself, not the table
    assert expected.strategy == "zero1"  # the least sharding that fits (README); the table lists every strategy
    # the command to run is the recommended one, with its overrides
    (command,) = [ln.strip() for ln in lines if ln.strip().startswith("python run.py ")]
    assert command == expected.command("gpt_7b"), command
    assert command.startswith("python run.py strategy=zero1 ") and "trainer.devices=8" in command
