"""The step-time model (``costs/step_time.py``): its FLOP count against torch's FLOP counter on the
models themselves, and what it hides, exposes and idles."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_par.costs.shape import Shape
from lightning_par.costs.comm import step_comm_bytes
from lightning_par.costs.step_time import Device, flops_per_token, step_time
from lightning_par.models.gpt import GPT
from lightning_par.models.moe import MoEGPT


def counted_flops_per_token(shape: Shape, batch: int = 2) -> float:
    """torch's FLOP counter over forward + backward of the model ``shape`` builds, on the meta device."""
    config = shape.gpt_config(dense=not shape.n_experts)
    with torch.device("meta"):
        net = MoEGPT(config) if shape.n_experts else GPT(config)
        x = torch.zeros(batch, shape.seq_len, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        out = net(x)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    return counter.get_total_flops() / (batch * shape.seq_len)


@pytest.mark.parametrize("shape", [
    Shape(4, 256, 4, 1024, 128),  # a small GPT: the head and attention weigh a lot
    Shape(2, 512, 8, 50304, 512, bias=False),  # a large vocabulary
    Shape(4, 256, 4, 1024, 128, n_experts=8, top_k=2, moe_every=1),  # MoE: the routed experts count top_k times
])
def test_flops_per_token_equal_torchs_counter(shape):
    """Within 2% (what the analytic count leaves out: norms, softmax, the router's top-k -- not matmuls)."""
    assert flops_per_token(shape) == pytest.approx(counted_flops_per_token(shape), rel=0.02)


def test_overlap_bubble_and_offload():
    shape = Shape(8, 1024, 8, 32000, 1024, bias=False)
    dev = Device(peak_tflops=100.0, efficiency=0.5, latency_us=0.0)
    n = shape.units()["total"]
    small = {"dp_replicate": 1.0}  # GB/s: DDP's all-reduce is small next to compute or not, by bandwidth
    ddp = step_comm_bytes("ddp", n_params=n, mesh={"dp_replicate": 8})
    fast = step_time(shape, traffic="all_reduce", mesh={"dp_replicate": 8}, global_batch=64, comm=ddp,
                     bandwidth_gbs={"dp_replicate": 1e4}, device=dev)
    slow = step_time(shape, traffic="all_reduce", mesh={"dp_replicate": 8}, global_batch=64, comm=ddp,
                     bandwidth_gbs=small, device=dev)
    assert fast.comm_exposed == 0.0 and fast.total == fast.compute  # hidden behind backward
    assert slow.comm_exposed > 0 and slow.total == pytest.approx(slow.compute + slow.comm_exposed)
    # ZeRO-2's one reduce-scatter after backward and its all-gather after the step: exposed whole
    z2 = step_comm_bytes("zero2", n_params=n, mesh={"dp_shard": 8})
    zero2 = step_time(shape, traffic="zero2", mesh={"dp_shard": 8}, global_batch=64, comm=z2,
                      bandwidth_gbs={"dp_shard": 1e4}, device=dev)
    assert zero2.comm_exposed > 0
    # the same model FLOPs whatever the plan; MFU = model FLOPs / (time x devices x peak)
    assert zero2.model_flops == fast.model_flops == pytest.approx(flops_per_token(shape) * 1024 * 64)
    assert fast.mfu == pytest.approx(0.5)  # no exposed communication: the efficiency itself
    # a pipeline's bubble: (p-1)/(m+p-1) of the step for 1F1B, a v-th of it interleaved
    one = step_time(shape, traffic="pipeline", mesh={"pp": 4}, global_batch=8, comm={}, bandwidth_gbs={},
                    device=dev, micro_batches=8)
    inter = step_time(shape, traffic="pipeline", mesh={"pp": 4}, global_batch=8, comm={}, bandwidth_gbs={},
                      device=dev, micro_batches=8, schedule="interleaved_1f1b", virtual_stages=2)
    assert one.bubble / one.total == pytest.approx(3 / 11) and inter.bubble / inter.total == pytest.approx(3 / 19)
    # recomputation costs a forward (4/3 of the compute) but no model FLOPs
    rec = step_time(shape, traffic="all_reduce", mesh={"dp_replicate": 8}, global_batch=64, comm={},
                    bandwidth_gbs={}, device=dev, recompute=True)
    assert rec.compute == pytest.approx(fast.compute * 4 / 3) and rec.model_flops == fast.model_flops
    # offload: the host's Adam step is on the critical path
    off = step_time(shape, traffic="fsdp", mesh={"dp_shard": 8}, global_batch=64, comm={}, bandwidth_gbs={},
                    device=dev, offloaded_params=n // 8)
    assert off.offload == pytest.approx(28 * (n // 8) / (dev.host_adam_gbs * 1e9))
    # the disk tier: the step takes the longer of the host's Adam and its states in and out of the files
    # (32 bytes per parameter), and the gathers' reads and the gradient accumulation run beside compute
    slow_disk = step_time(shape, traffic="fsdp", mesh={"dp_shard": 8}, global_batch=64, comm={}, bandwidth_gbs={},
                          device=dev, offloaded_params=n // 8, disk_gbs=0.5)
    fast_disk = step_time(shape, traffic="fsdp", mesh={"dp_shard": 8}, global_batch=64, comm={}, bandwidth_gbs={},
                          device=dev, offloaded_params=n // 8, disk_gbs=1e4)
    assert slow_disk.offload == pytest.approx(32 * (n // 8) / 0.5e9) and slow_disk.offload > off.offload
    assert fast_disk.offload == off.offload and fast_disk.total == pytest.approx(off.total)
    reads = 16 * (n // 8) / 0.5e9  # per micro-batch, beside the compute: exposed only beyond it
    assert slow_disk.comm_exposed == pytest.approx(max(0.0, reads + (2 * 2 + 4) * (n // 8) / (dev.host_link_gbs * 1e9)
                                                       - slow_disk.compute))


def test_critical_path_latency_counts_collectives():
    """Tensor parallelism's per-layer collectives cost their start-up latency even when tiny."""
    shape = Shape(4, 64, 2, 256, 32)
    dev = Device(latency_us=20.0)
    plain = step_time(shape, traffic="none", mesh={}, global_batch=1, comm={}, bandwidth_gbs={}, device=dev)
    tp = step_time(shape, traffic="tensor_parallel", mesh={"tp": 2}, global_batch=1, comm={}, bandwidth_gbs={},
                   device=dev)
    assert tp.comm_exposed == pytest.approx((6 * 4 + 2) * 20e-6) and plain.comm_exposed == 0.0


def test_chunked_loss_charges_the_heads_recomputed_forward():
    """``model.chunked_loss`` checkpoints each chunk of the loss: torch's FLOP counter over a real step
    (forward, chunked loss, backward; CPU, a small GPT) counts exactly the head's forward matmul more than
    the unfused step, which is what the step model adds (``recomputed_head_flops``)."""
    import dataclasses

    from lightning_par.costs.step_time import recomputed_head_flops
    from lightning_par.models.module import cross_entropy
    from lightning_par.parallel.memory.chunked_loss import chunked_loss_option, make_chunked

    shape = Shape(2, 64, 2, 512, 32)
    batch, counts = 2, {}
    for chunked in (False, True):
        torch.manual_seed(0)
        net = GPT(shape.gpt_config())
        x = torch.randint(0, shape.vocab_size, (batch, shape.seq_len))
        if chunked:
            head = make_chunked(net.get_output_embeddings(), chunked_loss_option(16))
        with FlopCounterMode(display=False) as counter:
            out = net(x)
            loss = head.loss(out, x) if chunked else cross_entropy(out, x)
            loss.backward()
        counts[chunked] = counter.get_total_flops()
    chunked_shape = dataclasses.replace(shape, loss_chunk=16)
    assert counts[True] - counts[False] == recomputed_head_flops(chunked_shape) * batch > 0
    assert recomputed_head_flops(shape) == 0
    args = dict(traffic="none", mesh={}, global_batch=batch, comm={}, bandwidth_gbs={}, device=Device())
    extra = step_time(chunked_shape, **args).compute - step_time(shape, **args).compute
    assert extra == pytest.approx(recomputed_head_flops(chunked_shape) * batch / (989e12 * 0.5))


def test_every_kth_block_recomputes_its_share_of_a_forward():
    """``activation_checkpointing=k``: the blocks 0, k, 2k, ... recompute their forward -- ceil(L / k) of L
    blocks, so a third of a plain step's compute times that share; full checkpointing is k = 1."""
    shape = Shape(4, 256, 4, 1024, 128)
    args = dict(traffic="none", mesh={}, global_batch=2, comm={}, bandwidth_gbs={}, device=Device())
    plain = step_time(shape, **args).compute
    assert step_time(shape, recompute=2, **args).compute == pytest.approx(plain * (1 + 2 / 4 / 3))
    assert step_time(shape, recompute=3, **args).compute == pytest.approx(plain * (1 + 2 / 4 / 3))  # blocks 0 and 3
    assert step_time(shape, recompute="full", **args).compute == pytest.approx(plain * 4 / 3)
