"""The per-rank peak of one training step: model states plus a walk through the backward pass.

The peak of a step is the largest of (docs/cost_model.md):

- the backward pass, unit by unit from the loss down (head, blocks top to bottom, embedding): at
  unit ``u`` a rank holds its parameters and optimizer state, the gradients produced so far (per
  the strategy: DDP's buckets hold all of them from the start; ZeRO-2 accumulates full-size
  gradients until its one reduce-scatter; FSDP keeps reduce-scattered shards plus the current
  unit's full-size gradient), the activations of every unit not yet done (times the micro-batches
  in flight on a pipeline stage), the unit's own transient (the loss's two fp32 B x T x V buffers,
  a block's inner gradients, a checkpointed block's recomputed activations), and under FSDP the
  all-gathered parameters (the root unit -- embedding and head, gathered again for backward: the loss
  runs with nothing gathered -- plus the current unit and ``prefetch`` more);
- the optimizer step: parameters, gradients, optimizer state and the step's temporaries (torch's
  foreach Adam: one state-sized temporary; the fused CUDA kernels: none; ZeRO-2: the full-size
  ``.grad``s and the flat copy it reduce-scatters from).

Offloaded states (``zero3_offload`` / ``fsdp cpu_offload``) live in host memory: the device holds
the gathered units, one unit's gradient and the activations. On a CPU (``device="cpu"``) the host is
the device: ``peak`` then includes the offloaded states, and the host's optimizer step (the states and
foreach Adam's state-sized temporary) is one of its moments. With the disk tier (``offload_dir``) they
live in files (``on_disk``) and host memory holds the optimizer step's chunks (``states.disk_tier_resident``).

With LoRA (``shape.lora``) gradients, optimizer states and their sharding follow the trainable parameters only
(``lora_states``: the adapters), the frozen ones are weights only, NF4 under ``lora.base=nf4`` (gathered so by
FSDP), and the activations are ``activations.lora_layer_bytes_per_token``'s and ``lora_model_bytes``'.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_par.costs import activations as act
from lightning_par.costs.counting import tiled_part
from lightning_par.costs.shape import Shape
from lightning_par.parallel.memory.checkpointing import checkpointed_share
from lightning_par.costs.states import bytes_per_param, disk_tier_resident, nf4_bytes, optimizer_state_bytes
# what a rank holds is declared by the strategy catalogue; this module prices it
from lightning_par.parallel.layout import GRAD_MODES, Layout  # noqa: F401 -- re-exported

#: what cuBLAS holds on a CUDA device through the step, in the caching allocator (so within
#: ``torch.cuda.max_memory_allocated``): torch gives each (thread's handle, stream) pair a workspace of
#: ``CUBLAS_WORKSPACE_CONFIG``'s size -- by default 32 MiB on compute capability 9.0 (H100/H200), 8 MiB
#: (4096 KiB x 2 + 16 KiB x 8) before -- and a training step has two such pairs: the forward's thread and
#: autograd's device thread, on the same stream. Priced at Hopper's size. (torch's CublasHandlePool.cpp
#: allocates them through the caching allocator; the sizes are its defaults; not yet checked on a GPU.)
CUBLAS_WORKSPACES = 2 * 32 * 2**20


@dataclass(frozen=True)
class Peak:
    params: int
    grads: int
    optimizer_state: int
    offloaded: int
    activations: int
    peak: int
    moment: str  # where the peak falls
    on_disk: int = 0  # the disk tier's files (``offloaded`` is then what its step pages into host memory)
    shared_host: int = 0  # offloaded bytes ``peak`` includes: on a CPU the host is the device

    @property
    def transient(self) -> int:
        return max(0, self.peak - self.params - self.grads - self.optimizer_state - self.activations - self.shared_host)


def step_peak(shape: Shape, layout: Layout, *, micro_batch_size: int, precision: str, optimizer: str,
              checkpointing: bool | str = False, device: str = "cuda") -> Peak:
    """Predicted per-rank bytes (the rank that holds the most: pipeline first or last stage).
    ``checkpointing``: False, True / ``"full"`` (every block keeps its input only), ``"selective"``
    (every block keeps its input and its matmul outputs, ``activations.selective_layer_bytes_per_token``) or
    k >= 2 (every k-th block keeps its input only: priced as the average block, with a full block's
    recomputation as the backward's transient)."""
    if shape.n_moe_layers and layout.tp > 1:
        raise ValueError(f"the estimator does not price tensor parallelism of an MoE model (tp={layout.tp}: its MoE "
                         "layers run whole on every tp rank); estimate it with tp=1")
    stages = ("first", "last") if layout.pp > 1 else ("all",)
    return max((_stage_peak(shape, layout, role, micro_batch_size, precision, optimizer, checkpointing, device)
                for role in stages), key=lambda r: r.peak)


def _stage_peak(shape: Shape, lay: Layout, role: str, micro: int, precision: str, optimizer: str,
                ckpt: bool | str, device: str) -> Peak:
    u = shape.units()
    p, g, _ = bytes_per_param(precision, optimizer)
    tp, pp = lay.tp, lay.pp
    layers = -(-shape.n_layer // pp)
    has_embed, has_head = role in ("all", "first"), role in ("all", "last")
    n_micro = lay.n_microbatches or pp
    tokens = micro * shape.seq_len / (n_micro if pp > 1 else 1)  # one pipeline micro-batch
    in_flight = act.in_flight_micro_batches(lay.schedule, pp, n_micro, lay.virtual_stages) if role == "first" else 1
    # parameters this stage holds, before data-parallel sharding (TP splits every matrix; EP the experts)
    dense_part, expert_part, block_unit = layer_params(shape, u, lay)
    block = dense_part + expert_part  # the average layer
    embed = u["embed"] / tp if has_embed else 0
    # a head tied to the embedding (Hugging Face's tie_word_embeddings) shares its table where both are
    # on this rank; a pipeline's first and last stages each hold a copy (parallel/pipeline/stage_ties.py)
    head = (u["head"] - (u.get("tied", 0) if has_embed else 0)) / tp if has_head else 0
    local = embed + layers * block + head
    shard = lay.shard if lay.params_sharded or lay.opt_sharded or lay.grads in ("zero2", "fsdp") else 1
    experts = layers * expert_part  # sharded over their own data axis (expert parallelism x FSDP)
    psi_shard = -(-int(local - experts) // shard) + -(-int(experts) // (lay.expert_shard or shard))
    # what trains (LoRA: the adapters; else every parameter) gets gradients and optimizer states; the frozen rest
    # is weights only, and with lora.base=nf4 the adapted linears' base weights are NF4 (``lora_states``)
    t = lora_states(shape, lay, p, has_embed, has_head, layers, embed, block, head, precision)
    trainable, t_shard = t.local, (-(-int(t.local) // shard) if t.lora else psi_shard)
    params = p * (psi_shard if lay.params_sharded else local) - t.nf4_saved / (shard if lay.params_sharded else 1)
    if lay.params_sharded:  # an NF4 shard keeps its tensor's scalers' mean and code table whole
        params += t.nf4_replicated * (1 - 1 / shard)
    opt_elems = t_shard if lay.opt_sharded else int(trainable)
    opt = optimizer_state_bytes(opt_elems, optimizer, precision)
    grads_steady = g * (t_shard if lay.grads in ("zero2", "fsdp") else trainable)
    if lay.grads == "accumulate" or lay.unsharded_grads:
        grads_steady = g * trainable  # held between backward and the step (freed by zero_grad)
    host = 0
    host_temp = 0.0
    if lay.cpu_offload:
        # the step runs on the host over the offloaded states: torch's foreach Adam (core/optim.py) adds one
        # state-sized temporary there, as on a device
        host_temp = opt / 2 if optimizer in ("adamw", "adam") else 0.0
        host, params, opt, grads_steady = int(params + opt + grads_steady), 0, 0, 0

    # activations per micro-batch: FSDP mixed precision's bf16 parameters make a 32-true run compute in
    # bf16 (its activations, no autocast copies), as bf16-true does
    precision = "bf16-true" if lay.grads == "fsdp" and lay.gather_bytes == 2 and precision == "32-true" else precision
    selective = ckpt == "selective"  # matmul outputs kept, the rest recomputed; True / "full": whole blocks
    every = ckpt if type(ckpt) is int and ckpt >= 2 else None  # every k-th block whole, the others keep everything
    ckpt = bool(ckpt) and not selective
    if selective and tp > 1:
        raise ValueError("the estimator does not price selective checkpointing under tensor parallelism")
    lt = act.layer_bytes_per_token(shape, precision, device=device, tp=tp, sequence_parallel=lay.sequence_parallel)
    # a tiled linear is checkpointed tile by tile (parallel/parallelize.py): one tile's weight copy at a time
    names = {part: v for k, v in lay.tiling.items() if (part := tiled_part(shape, k)) and part.startswith("block.")}
    matmul = u["block_matmul"] - sum(u[n] for n in names if n in u) + max([u[n] / k for n, k in names.items()
                                                                            if n in u] or [0])
    if shape.n_moe_layers:  # the average layer: an MoE layer multiplies by its router, shared expert and local experts
        share = shape.n_moe_layers / shape.n_layer
        matmul += share * (u["moe_matmul"] + u["moe_experts"] / lay.ep - u["block_matmul"])
    # LoRA: autocast copies of the adapters too; an NF4 weight is dequantised for each use and saved as NF4 (none)
    matmul += t.copies_extra
    copies = act.weight_copy_bytes(int(matmul), precision, tp)
    full_layer = lt * tokens + copies  # what a block saves without checkpointing
    if ckpt:
        keep = act.checkpoint_bytes_per_token(shape, precision, tp, lay.sequence_parallel) * tokens
        if every:  # the average block: a share of them checkpointed (a checkpointed one's recompute transient stays)
            share = checkpointed_share(shape.n_layer, every)
            keep = share * keep + (1 - share) * full_layer
    elif selective:
        keep = act.selective_layer_bytes_per_token(shape, precision, device=device) * tokens
    else:
        keep = full_layer
    # brought back for one block's backward: all of it (full), what was not kept (selective), nothing (none)
    recomputed = full_layer if ckpt else max(0.0, full_layer - keep)
    head_saved = (act.head_bytes_per_token(shape, precision, tp=tp, loss_parallel=lay.loss_parallel) * tokens
                  + act.weight_copy_bytes(u["lm_head"], precision, tp)) if has_head else 0
    embed_saved = act.embed_bytes_per_token(shape, precision, device) * tokens if has_embed else 0
    # LoRA with a frozen embedding: the first block's first norm (and its autocast weight copies) save nothing
    first_tokens, first_fixed, _ = act.lora_model_bytes(shape, precision, tp=tp, device=device)
    first_less = first_tokens * tokens + first_fixed if has_embed and not ckpt and not selective else 0.0
    saved_all = in_flight * (layers * keep + embed_saved - first_less) + head_saved

    # all-gathered parameters (FSDP): root unit kept from forward to backward + current and prefetched units
    gathered_root = gathered_unit = 0.0
    unit_max = block_unit
    if lay.grads == "fsdp":
        gb = lay.gather_bytes or p
        root, unit_max = fsdp_units(u, lay, has_embed, has_head, block_unit, embed, head, shape)
        gathered_root = gb * root
        # float8 gathers (model.float8=tensorwise): a block's linear weights at 1 byte (the root holds none)
        f8 = u["block_matmul"] / tp if lay.float8_gather and unit_max == block_unit else 0.0
        gathered_unit = (gb * unit_max - (gb - 1) * f8) * (1 + lay.prefetch)
        if shard == 1 and not lay.cpu_offload:
            gathered_root = gathered_unit = 0.0

    if gathered_unit and t.nf4_unit_elems and unit_max == block_unit:  # a block gathered with its weights in NF4
        gathered_unit -= (gb * t.nf4_unit_elems - t.nf4_unit_bytes) * (1 + lay.prefetch)

    base = params + opt + (CUBLAS_WORKSPACES if device == "cuda" else 0)
    largest = max(u["embed_table"] if has_embed else 0, u["lm_head"] if has_head else 0, u["block_linear"]) / tp
    if t.lora:
        largest = t.largest
    moments = {}
    # backward at the loss (head): all activations, the loss buffers
    done = 0.0  # trainable parameters whose gradients exist
    for name, saved_now, transient, unit_params, unit_trainable in _backward_units(
            shape, lay, has_embed, has_head, layers, in_flight, keep, recomputed, embed_saved - first_less,
            head_saved, tokens, precision, tp, head, block, embed, t):
        grads_now = _grads_during_backward(lay, g, trainable, t_shard, done,
                                           unit_trainable * min(1.0, unit_max / max(unit_params, 1)), largest)
        # (the chunked loss keeps the root gathered from forward to backward: parallelize)
        if name == "loss" and lay.grads == "fsdp" and lay.reshard_after_forward and gathered_root and not shape.loss_chunk:
            # the loss runs after the root's forward resharded every unit (this repository reshards the
            # root too): nothing is gathered. The head's backward gathers the root again -- its all-gather
            # buffer and the unsharded parameters copied out of it both alive -- when the loss's fp32
            # logits are freed and their gradient (the other of its two buffers) is left: measured equal
            # to FSDPMemTracker's peak there (tests/test_fsdp_peak.py)
            held = g * local if lay.unsharded_grads else 0.0  # earlier micro-batches' unsynchronised gradients
            moments["backward loss"] = base + held + saved_now + transient
            moments["backward head"] = base + held + saved_now + 2 * gathered_root
        else:
            moments[f"backward {name}"] = base + grads_now + saved_now + transient + gathered_root + gathered_unit
        done += unit_trainable
    # the optimizer step
    temp = 0.0
    if lay.cpu_offload:
        pass  # the step runs on the host
    elif lay.grads == "zero2":  # AdamW's temporary, or the chunks copied out for two buckets' all-gathers
        adam = opt / 2 if optimizer in ("adamw", "adam") and device == "cpu" else 0.0
        temp = max(min(2 * lay.bucket_bytes, p * t_shard), adam)
    elif optimizer in ("adamw", "adam") and device == "cpu":
        temp = opt / 2  # foreach: one state-sized temporary (sqrt of v)
    moments["optimizer step"] = base + grads_steady + temp
    moment = max(moments, key=moments.get)
    act_bytes = saved_all
    on_disk = 0
    if lay.disk_offload and host:
        on_disk, resident = host, disk_tier_resident(host, psi_shard, largest)
        host_temp *= resident / host  # its step runs chunk by chunk: a chunk's temporary
        host = resident
    shared = 0
    if lay.cpu_offload and device == "cpu":
        # on a CPU the host is the device: every moment also holds the offloaded states, and the host's
        # optimizer step is a moment of its own (bench_tiled_rss: without it zero3_offload's estimate was
        # 0.81 of the measured RSS)
        shared = host
        moments = {k: v + host for k, v in moments.items()}
        moments["optimizer step"] = host + host_temp
        moment = max(moments, key=moments.get)
    return Peak(int(params), int(grads_steady), int(opt), int(host), int(act_bytes), int(moments[moment]), moment,
                int(on_disk), shared)


def layer_params(shape: Shape, u: dict, lay: Layout) -> tuple[float, float, float]:
    """(dense parameters, routed-expert parameters) of the average layer on one rank, and the
    largest layer: a dense GPT's layers are all ``block``; in an MoE model every ``moe_every``-th
    block's MLP is the router, the routed experts (1/ep of them per rank under expert parallelism)
    and an optional shared expert."""
    tp = lay.tp
    if not shape.n_moe_layers:
        return u["block"] / tp, 0.0, u["block"] / tp
    n, moe = shape.n_layer, shape.n_moe_layers
    moe_dense = u["moe_block"] - u["moe_experts"]
    experts = u["moe_experts"] / lay.ep
    dense = ((n - moe) * u["block"] + moe * moe_dense) / n
    largest = max(u["block"] if moe < n else 0, moe_dense + experts)
    return dense / tp, moe * experts / n / tp, largest / tp


def fsdp_units(u: dict, lay: Layout, has_embed: bool, has_head: bool, block: float, embed: float,
               head: float, shape: Shape | None = None) -> tuple[float, float]:
    """(root unit, largest other unit) in parameters on one rank: the root holds what no unit claims
    (embedding, final norm, head); blocks are units; each tile of a tiled layer is a unit of its own
    (``parallel/memory/tiling.py``: ``net.head.lm_head``, ``net.embed.tok`` or ``net.blocks.<i>.<path>``,
    a Hugging Face model's own paths by ``shape``: ``costs/counting.tiled_part``; every block is
    assumed tiled alike)."""
    tp = lay.tp
    tiles, block_unit, root = [], block, embed + head
    shared, shared_done = u.get("tied", 0), False
    for path, k in lay.tiling.items():
        part = tiled_part(shape, path) if shape is not None else tiled_part(_GPT, path)
        if part in ("head", "embed") and shared:
            # a tied table is tiled once, for both its uses, whichever is named (parallel/memory/tiling.py): the
            # root held it once (or, on one pipeline stage, its copy)
            if not shared_done and (has_embed or has_head):
                root -= shared / tp
                tiles.append(shared / tp / k)
            shared_done = True
        elif part == "head" and has_head:
            root -= u["lm_head"] / tp
            tiles.append(u["lm_head"] / tp / k)
        elif part == "embed" and has_embed:  # the vocabulary in row tiles
            root -= u["embed_table"] / tp
            tiles.append(u["embed_table"] / tp / k)
        elif part and part.startswith("block."):
            name = part
            if name in u:
                block_unit -= u[name] / tp  # the layer's tiles are units of their own
                tiles.append(u[name] / tp / k)
    return root, max([block_unit, *tiles])


#: a GPT shape: ``fsdp_units`` called without one reads our GPT's tiling paths
_GPT = Shape(1, 1, 1, 1, 1)


def _backward_units(shape, lay, has_embed, has_head, layers, in_flight, keep, recomputed, embed_saved, head_saved,
                    tokens, precision, tp, head, block, embed, t):
    """(name, activations alive, transient, unit parameters, of them trainable) for each unit in backward order.
    ``embed_saved``: what the embedding saves, less (LoRA) what the first block saves less than the others."""
    below = in_flight * embed_saved
    if has_head:
        loss = act.loss_transient_bytes(shape, tokens, tp=tp, loss_parallel=lay.loss_parallel)
        yield "loss", below + in_flight * layers * keep + head_saved, loss, head, t.head
    # QLoRA: each NF4 linear dequantises its weight for its input gradient (torchao's LinearNF4)
    inner = act.layer_backward_transient_per_token(shape, precision, tp) * tokens + t.dequantised
    for i in range(layers, 0, -1):
        # a checkpointed block's activations, recomputed for its backward (0 without checkpointing)
        alive = below + in_flight * i * keep + recomputed
        yield f"block {i - 1}", alive, inner, block, t.block
    if has_embed:
        yield "embedding", max(0.0, below), 0.0, embed, t.embed


@dataclass(frozen=True)
class LoRAStates:
    """What trains on one pipeline stage (before data-parallel sharding) and what NF4 saves: ``lora_states``."""

    lora: bool
    local: float  # trainable parameters on the stage
    embed: float
    block: float
    head: float
    largest: float  # the largest trainable tensor
    nf4_saved: float = 0.0  # bytes the NF4 base saves against its weights in the parameters' dtype, on the stage
    nf4_unit_elems: float = 0.0  # one block's NF4 weights: elements
    nf4_unit_bytes: float = 0.0  # and bytes
    nf4_replicated: float = 0.0  # of the stage's NF4 bytes, those every FSDP shard keeps whole (per tensor: 17 values)
    copies_extra: float = 0.0  # autocast weight copies of a block: + adapters, - NF4 weights
    dequantised: float = 0.0  # the largest NF4 weight dequantised for its matmul (bytes)


def lora_states(shape: Shape, lay: Layout, p: float, has_embed: bool, has_head: bool, layers: int,
                embed: float, block: float, head: float, precision: str = "32-true") -> LoRAStates:
    """The trainable parameters of a stage by part (LoRA: the adapters and ``lora.train``'s modules, split by tp as
    their base layer's plan splits them: ``counting.lora_units``; without LoRA: every parameter) and, with
    ``lora.base=nf4``, what storing the adapted linears' base weights as torchao NF4 saves (``states.nf4_bytes``:
    about 0.52 bytes per value instead of ``p``), per stage and per block (FSDP gathers a block's NF4 weights as
    NF4), and the one dequantised weight each NF4 linear makes for its matmul in forward and backward (torchao's
    ``LinearNF4``: ``weight.to(input.dtype)``, in the parameters' dtype, and under autocast the matmul's cast of it
    to the compute dtype). ``embed`` / ``block`` / ``head``: the stage's parameters by part (what trains without
    LoRA)."""
    tp = lay.tp
    if shape.lora is None:
        return LoRAStates(False, embed + layers * block + head, embed, block, head, 0.0)
    lo = shape.lora_units()
    block = lo["block_trainable_split"] / tp + lo["block_trainable"] - lo["block_trainable_split"]
    embed = lo["embed_trainable"] / tp if has_embed else 0.0  # (a trained embedding or head: split like its base)
    head = (lo["head_trainable"] - (lo["tied_trainable"] if has_embed else 0)) / tp if has_head else 0.0
    out = LoRAStates(True, embed + layers * block + head, embed, block, head, lo["largest_trainable"],
                     copies_extra=lo["block_lora"])
    if shape.lora.base != "nf4":
        return out
    c, _, autocast = act.dtypes(precision)
    elems = sum(n / tp for n in lo["block_adapted_numels"])
    stored = sum(nf4_bytes(int(n // tp), int(p)) for n in lo["block_adapted_numels"])
    return replace(out, nf4_saved=layers * (p * elems - stored), nf4_unit_elems=elems, nf4_unit_bytes=stored,
                   nf4_replicated=layers * len(lo["block_adapted_numels"]) * 17 * p,
                   copies_extra=lo["block_lora"] - lo["block_adapted"],
                   dequantised=(p + (c if autocast else 0)) * max(lo["block_adapted_numels"]) / tp)


#: ZeRO-2's reduce-scatter buckets alive during backward: ``Zero2Optimizer``'s two in flight and the one filling
ZERO2_BUCKETS_ALIVE = 3


def zero2_staged(lay: Layout, g: float, local: float, largest: float) -> float:
    """Bytes of ZeRO-2's staged gradient buckets during backward (``parallel/sharding/zero.py``): up to
    ``ZERO2_BUCKETS_ALIVE`` buckets of ``lay.bucket_bytes`` (a parameter larger than that, e.g. the
    embedding, is a bucket of its own: ``largest`` parameters), never more than the local gradients."""
    return min(g * local, ZERO2_BUCKETS_ALIVE * max(lay.bucket_bytes, g * largest))


def _grads_during_backward(lay: Layout, g: float, local: float, psi_shard: int, done: float, unit: float,
                           largest: float) -> float:
    if lay.unsharded_grads:  # FSDP without gradient sync: every unsharded gradient since the first micro-batch
        return g * local
    if lay.cpu_offload:
        return g * unit  # one unit's full-size gradient on the device before it moves to the host
    if lay.grads == "bucket":
        return g * local
    if lay.grads == "zero2":  # the reduced shard + the buckets staged for their reduce-scatters
        return g * psi_shard + zero2_staged(lay, g, local, largest)
    if lay.grads == "fsdp":
        # reduce-scattered to this rank's shard: psi_shard / local of them (the experts are sharded over
        # their own, smaller data axis, so dividing by the world's shard would count them too small)
        return g * (done * psi_shard / max(1.0, local) + unit)
    return g * (done + unit)
