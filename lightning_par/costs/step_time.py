"""Predicted time of one optimizer step, and the MFU it implies: what the advisor ranks plans by.

    step = compute + exposed communication + pipeline bubble + offload

- **compute**: the hardware FLOPs of this rank's share of the step -- the model FLOPs of its
  data-parallel replica's tokens, divided over its ``tp x pp`` ranks, plus the recomputed forward
  under activation checkpointing and the output layer's recomputed forward under a chunked loss
  (``recomputed_head_flops``) -- at ``efficiency`` of the device's dense peak. Model FLOPs per
  token are ``flops_per_token``: 6 per weight a token is multiplied by (forward 2, backward 4; the
  embedding lookup is free, the output head is not; MoE blocks count their router, shared parts and
  ``top_k`` experts), plus attention's ``QK^T`` and ``AV`` over the whole sequence (12 s h per layer:
  torch's FLOP counter counts SDPA without the causal half, and so does the run's MFU).
- **communication** (``costs/comm.py``'s bytes x bus factor / the axis' bandwidth) is split in two,
  by where each strategy issues it (``OVERLAPPED``): DDP's and ZeRO-1's bucketed all-reduces run
  during backward, FSDP prefetches its all-gathers and reduce-scatters during backward, so that
  traffic runs beside compute and only what exceeds the compute time is exposed; tensor-parallel,
  expert-parallel (all-to-all) and pipeline traffic, ZeRO-2's one reduce-scatter after backward, the
  collectives after the optimizer step (ZeRO-1's broadcast, ZeRO-2's all-gather) and the mesh
  strategies' average of replicated gradients after backward sit on the critical path, exposed whole.
  Each critical-path collective also costs its start-up latency (``latency_us``: per layer TP's 6
  (2 + ``Shape.colwise_inputs``: 7 with a gated MLP),
  expert parallelism's 4 all-to-alls per MoE layer and 2 more under recomputation, 2 pipeline
  transfers per micro-batch and stage), which dominates for small models. ``Device.overlap`` is the
  share of the overlappable traffic a device really hides: 1 on a GPU (its own streams), 0 on a CPU
  with gloo, whose collectives take the cores the matmuls need -- then every call's latency counts.
- **QLoRA** (``lora.base=nf4``): each use of an NF4 weight (forward, the input gradient in backward, a
  recomputed forward) dequantises it first (torchao's ``LinearNF4``), a memory-bound pass that reads its codes
  and scalers and writes, then the matmul reads, the weight in the compute dtype (``NF4_PASS_BYTES`` per
  element) at ``Device.memory_gbs``, on the critical path.
- **bubble**: a pipeline rank idles ``f / (1 - f)`` of its compute, ``f`` the schedule's theoretical
  bubble fraction (``parallel/pipeline.theoretical_bubble``: ``(p-1)/(m+p-1)`` for GPipe/1F1B,
  ``(p-1)/(v m+p-1)`` interleaved).
- **offload** (ZeRO-3 with the states in host memory): every micro-batch copies the rank's parameter
  shard to the device twice (forward and backward gathers) and its gradient shard back once, over the
  host link (overlapped with compute like the gathers); the optimizer step then runs on the host
  (``host_adam_gbs``: bytes of parameters, gradients and fp32 states read and written per second),
  after backward, exposed whole.
- **disk tier** (the same states in files, ``parallel/sharding/disk_offload.py``; ``disk_gbs``: this rank's
  share of its node's disk bandwidth, read and write alike): the worst case, states larger than
  the page cache. Every micro-batch reads the parameter shard in the forward and backward gathers
  and reads and writes the gradient shard it accumulates into (16 bytes per parameter: fp32 files),
  beside compute like the host copies; the step reads parameters, gradients and both moments and
  writes them back (32 bytes per parameter), its prefetch and write-back threads running beside the
  host's Adam, so the step takes the longer of the two.

The figures are a model, not a measurement: a plan's rank among others is what the advisor uses.
``benchmarks/bench_step_time.py`` checks that rank against measured CPU step times.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_par.costs import comm as comm_model
from lightning_par.costs.shape import Shape
from lightning_par.parallel.memory.checkpointing import checkpointed_share, recomputed_moe_layers

#: the collective kinds each traffic model (``StrategyEntry.comm``) runs beside compute, on data axes
#: (tensor-parallel and pipeline traffic is on the critical path whatever its kind)
OVERLAPPED: dict[str, frozenset[str]] = {
    "none": frozenset(), "all_reduce": frozenset({"all_reduce"}), "zero1": frozenset({"all_reduce"}),
    "zero2": frozenset({"reduce_scatter", "all_reduce"}),
    "fsdp": frozenset({"all_gather", "reduce_scatter", "all_reduce"}),
    "tensor_parallel": frozenset(), "fsdp_tp": frozenset({"all_gather", "reduce_scatter"}),
    "pipeline": frozenset({"all_gather", "reduce_scatter"}), "3d": frozenset({"all_gather", "reduce_scatter"}),
    "expert_parallel": frozenset({"all_gather", "reduce_scatter"}),
}


#: bytes one use of an NF4 weight moves per element: its codes and scalers read (about 0.52), the dequantised weight
#: written and read again by the matmul (2 + 2, bf16)
NF4_PASS_BYTES = 4.5


def overlapped(traffic: str, kind: str, axis: str) -> bool:
    """Whether ``traffic``'s collective ``kind`` over ``axis`` runs beside compute."""
    return axis not in ("tp", "pp") and kind in OVERLAPPED[traffic]


@dataclass(frozen=True)
class Device:
    """What one accelerator computes and moves. Defaults: an H100 SXM (989 dense bf16 TFLOP/s), a
    PCIe Gen5 x16 host link at about half its nominal rate, and a host optimizer step bound by memory
    bandwidth (20 GB/s of states read and written: about 0.7 billion parameters per second per rank)."""

    peak_tflops: float = 989.0
    efficiency: float = 0.5  # fraction of the dense peak that large matmuls reach in a training step
    host_link_gbs: float = 25.0  # device <-> host, GB/s per device
    host_adam_gbs: float = 20.0  # bytes of optimizer traffic per second per rank for a host Adam step
    latency_us: float = 20.0  # start-up time of one collective on the critical path (NCCL, small messages)
    overlap: float = 1.0  # share of the overlappable traffic that runs beside compute: 1 on a GPU (its own
    # streams and copy engines); on a CPU with gloo the collectives use the cores the matmuls need: 0
    #: dense float8 TFLOP/s (an H100 SXM's 1979: twice its bf16); None: no float8 matmuls (emulated, no faster)
    float8_tflops: float | None = 1979.0
    memory_gbs: float = 3350.0  # device memory bandwidth, GB/s (an H100 SXM's HBM3): QLoRA's dequantisation


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by part, and the model FLOPs of the whole step (every rank)."""

    compute: float
    comm_exposed: float
    bubble: float
    offload: float
    model_flops: float
    devices: int
    peak_flops: float

    @property
    def total(self) -> float:
        return self.compute + self.comm_exposed + self.bubble + self.offload

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over the devices' dense peak (recomputation not counted)."""
        return self.model_flops / (self.total * self.devices * self.peak_flops) if self.total > 0 else 0.0


def flops_per_token(shape: Shape) -> float:
    """Training FLOPs (forward + backward) per token of ``shape`` at its sequence length.

    With LoRA (``shape.lora``) a frozen weight skips its weight-gradient matmul: 4 FLOPs per weight and token
    (forward 2, input gradient 2) instead of 6; the adapters take 6 per weight (A and B train); and where the
    embedding is frozen the first block's attention-input linears (and their A adapters) need no input gradient
    either (2: nothing before them trains) -- equal to torch's FLOP counter's count of a step on our GPT and a
    Llama, attention aside (tests/test_lora_costs.py)."""
    u = shape.units()
    attention = 4 * shape.seq_len * shape.n_embd * shape.n_layer  # QK^T and AV, forward
    if shape.lora is not None:
        lo = shape.lora_units()
        whole = sum(n_in * n_out for _, n_in, n_out, state, _ in lo["linears"] if state == "whole")
        block = 4 * u["block_matmul"] + 2 * whole + 6 * lo["block_lora"]
        head = (4 if lo["head_frozen"] else 6) * u["lm_head"]
        # the first block's attention-input linears and their A adapters compute no input gradient
        first = 2 * sum(n_in * (n_out + (lo["rank"] if state == "adapted" else 0))
                        for _, n_in, n_out, state, group in lo["linears"]
                        if group == "attn_in" and state != "whole") if lo["embed_frozen"] else 0
        return shape.n_layer * block + head - first + 3 * attention
    dense_layers = shape.n_layer - shape.n_moe_layers
    weights = dense_layers * u["block_matmul"] + u["lm_head"]
    if shape.n_moe_layers:
        per_expert = u["moe_experts"] / shape.n_experts
        weights += shape.n_moe_layers * (u["moe_matmul"] + shape.top_k * per_expert)
    return 3 * (2 * weights + attention)


def forward_flops_per_token(shape: Shape) -> float:
    """The forward's share of ``flops_per_token`` (what activation checkpointing runs again): a third of it
    without LoRA; with it 2 per weight and adapter weight, and attention's forward."""
    if shape.lora is None:
        return flops_per_token(shape) / 3
    u = shape.units()
    return (2 * (shape.n_layer * (u["block_matmul"] + shape.lora_units()["block_lora"]) + u["lm_head"])
            + 4 * shape.seq_len * shape.n_embd * shape.n_layer)


def float8_flops_per_token(shape: Shape) -> float:
    """The part of ``flops_per_token`` that ``model.float8`` moves to float8 matmuls: the dense blocks'
    linear layers (not the output head, not attention's ``QK^T``/``AV``, not the routed experts)."""
    return 6 * (shape.n_layer - shape.n_moe_layers) * shape.units()["block_matmul"]


def recomputed_head_flops(shape: Shape) -> float:
    """What ``model.chunked_loss`` adds per sequence: each chunk of tokens is checkpointed, so the output
    layer's forward matmul (2 FLOPs per weight and token) runs again in backward; nothing when it is off."""
    return 2.0 * shape.units()["lm_head"] * shape.seq_len if shape.loss_chunk else 0.0


def data_parallel_calls(traffic: str, shape: Shape, mesh: dict[str, int], forwards: int) -> int:
    """Collectives a strategy issues per step on its data axes (their latency is hidden with their
    bytes where they overlap compute): DDP's 25 MB buckets, ZeRO-1's buckets and its broadcasts
    (issued together, asynchronously: one latency), ZeRO-2's bucketed reduce-scatters per forward, its
    all-gathers (issued together) and flag all-reduce, FSDP's two gathers and one reduce-scatter per unit
    (the blocks and the root) and forward."""
    if not any(int(mesh.get(a, 1)) > 1 for a in ("dp_replicate", "dp_shard", "ep")):
        return 0
    u = shape.units()
    buckets = -(-u["total"] * 4 // (25 * 2**20))
    return {"all_reduce": buckets, "zero1": buckets + 1, "zero2": buckets * forwards + 2,
            "fsdp": 3 * (shape.n_layer + 1) * forwards, "fsdp_tp": 3 * (shape.n_layer + 1) * forwards,
            "pipeline": 3 * (shape.n_layer + 1), "3d": 3 * (shape.n_layer + 1),
            "expert_parallel": 3 * (shape.n_layer + 1) * forwards}.get(traffic, 0)


def step_time(shape: Shape, *, traffic: str, mesh: dict[str, int], global_batch: int, comm: dict[str, dict[str, int]],
              bandwidth_gbs: dict[str, float], device: Device, compute_bytes: int = 2, recompute: bool | str = False,
              schedule: str = "1f1b", micro_batches: int = 1, virtual_stages: int = 1,
              offloaded_params: int = 0, accumulate: int = 1, disk_gbs: float | None = None,
              float8: bool = False, offloaded_trainable: int | None = None) -> StepTime:
    """The step time of one plan. ``traffic``: the strategy's traffic model (``StrategyEntry.comm``);
    ``mesh``: axis sizes (``pp``, ``tp``, ``ep``, ``dp_*``); ``global_batch``:
    sequences per optimizer step over the whole job; ``comm``: ``costs/comm.step_comm_bytes``'s bytes;
    ``compute_bytes``: 2 when the matmuls run in bf16/fp16 (the peak is the bf16 one), 4 in fp32 (TF32:
    half of it); ``micro_batches`` / ``virtual_stages``: the pipeline's; ``offloaded_params``: parameters
    of this rank's shard kept in host memory (ZeRO-3 offload); ``accumulate``: forwards per step;
    ``disk_gbs``: the offloaded states are in files (the disk tier), read and written at this rank's GB/s;
    ``float8``: the dense blocks' linear layers compute in float8 (``model.float8``), at the device's float8
    peak and the same efficiency (no change where the device has none: emulated); ``offloaded_trainable``: of
    ``offloaded_params``, those that train (LoRA: the adapters), whose gradients come back and whose host step
    runs (None: all)."""
    devices = 1
    for size in mesh.values():
        devices *= int(size)
    tp, pp = int(mesh.get("tp", 1)), int(mesh.get("pp", 1))
    peak = device.peak_tflops * 1e12 * (1.0 if compute_bytes <= 2 else 0.5)
    model_flops = flops_per_token(shape) * shape.seq_len * global_batch
    # full checkpointing recomputes the forward (2 of 6 FLOPs per parameter-token; with LoRA's frozen base 2 of
    # about 4); selective recomputes no matmul (its pointwise recomputation is memory-bound time this FLOP model
    # does not see)
    forward = 1 / 3 if shape.lora is None else forward_flops_per_token(shape) / flops_per_token(shape)
    factor = 1 + forward if recompute in (True, "full") else 1.0
    if type(recompute) is int and recompute >= 2:  # every k-th block recomputed: that share of a forward
        factor = 1 + checkpointed_share(shape.n_layer, recompute) * forward
    rank_flops = model_flops / devices * factor
    if shape.loss_chunk:  # the chunked loss checkpoints each chunk: the head's forward matmul runs again in backward
        rank_flops += recomputed_head_flops(shape) * global_batch / devices
    fast = 0.0  # of rank_flops, those at the float8 peak
    if float8 and device.float8_tflops:
        fast = float8_flops_per_token(shape) * shape.seq_len * global_batch / devices * factor
    compute = (rank_flops - fast) / (peak * device.efficiency) + fast / (device.float8_tflops * 1e12 * device.efficiency
                                                                         if fast else 1.0)
    nf4 = shape.nf4_weights(compute_bytes, tp)[0] / pp  # QLoRA: this rank's NF4 weights, dequantised at each use
    if nf4:
        forwards_ = micro_batches if pp > 1 else accumulate
        uses = forwards_ * (2 + (factor - 1) / forward if shape.lora is not None and factor > 1 else 2)
        compute += uses * nf4 * NF4_PASS_BYTES / (device.memory_gbs * 1e9)
    axes = {**mesh, "world": devices}
    hidden = exposed = 0.0
    for kind, by_axis in comm.items():
        for axis, nbytes in by_axis.items():
            seconds = comm_model.predicted_seconds({kind: {axis: nbytes}}, axes, bandwidth_gbs)
            if overlapped(traffic, kind, axis):
                hidden += seconds
            else:
                exposed += seconds
    bubble = 0.0
    if pp > 1:
        from lightning_par.parallel.pipeline.schedule import theoretical_bubble

        f = theoretical_bubble(schedule, pp, micro_batches, virtual_stages)
        bubble = compute * f / (1 - f)
    offload = 0.0
    if offloaded_params:
        trains = offloaded_params if offloaded_trainable is None else offloaded_trainable
        copies = (2 * accumulate * compute_bytes * offloaded_params + 4 * trains) / (device.host_link_gbs * 1e9)
        hidden += copies
        # the host Adam step reads parameters, gradients and both moments and writes three of them back
        offload = 28 * trains / (device.host_adam_gbs * 1e9)
        if disk_gbs is not None:  # gathers' reads, gradient accumulation; the paged step: every state in and out
            hidden += (8 * accumulate * offloaded_params + 8 * accumulate * trains) / (disk_gbs * 1e9)
            offload = max(offload, 32 * trains / (disk_gbs * 1e9))
    exposed += max(0.0, device.overlap * hidden - compute) + (1 - device.overlap) * hidden
    forwards = micro_batches if pp > 1 else accumulate
    calls = 0
    if tp > 1:
        calls += forwards * ((2 + shape.colwise_inputs) * shape.n_layer // pp + 2)  # GPT: 6 per layer
    if int(mesh.get("ep", 1)) > 1:
        calls += forwards * (4 * shape.n_moe_layers
                             + 2 * recomputed_moe_layers(shape.n_layer, shape.moe_every, recompute))
    if pp > 1:
        calls += 2 * forwards * virtual_stages
    calls += (1 - device.overlap) * data_parallel_calls(traffic, shape, mesh, forwards)
    exposed += calls * device.latency_us * 1e-6
    return StepTime(compute, exposed, bubble, offload, model_flops, devices, peak)
