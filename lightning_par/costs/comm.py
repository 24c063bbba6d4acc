"""Predicted communication per training step and per rank, by collective kind and mesh axis.

Pure arithmetic (no ``torch.distributed``): the advisor uses it to show each candidate's bytes on
the links, and ``tests/test_comm.py`` holds it against what ``callbacks/comm.py`` counts in a run.
The formulas, with their derivation from this repository's code, are in ``docs/communication.md``.

Payload is the *full logical tensor* of a collective, as seen by one rank: the output of an
all-gather, the input of a reduce-scatter, the buffer of an all-reduce / broadcast, the input
buffer of an all-to-all, the tensor of a send or recv. (What crosses a link is a fraction of that:
``(n-1)/n`` for all-gather / reduce-scatter, ``2(n-1)/n`` for a ring all-reduce -- see
``bus_factor``.) Kinds: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
``broadcast``, ``send``, ``recv``. Axes: the names of ``parallel/mesh.py`` (``dp_replicate``,
``dp_shard``, ``tp``, ``pp``, ``ep``), and ``world`` for a group of every rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from lightning_par.costs.shape import Shape
from lightning_par.parallel.memory.checkpointing import recomputed_moe_layers
from lightning_par.strategies.catalog import entry

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")


def bus_factor(kind: str, n: int) -> float:
    """Bytes one rank moves over its link per payload byte with ring algorithms (nccl-tests' busbw)."""
    if n <= 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_to_all": (n - 1) / n}.get(kind, 1.0)


@dataclass(frozen=True)
class CommShape:
    """The cost model's ``Shape`` (``costs/shape.py``) at one micro-batch: what activation collectives
    and the parameter split depend on. Its sizes, parameter groups, norms and linears are the shape's
    own (our GPT / MoE, or a Hugging Face decoder).

    micro_batch: sequences in one forward on one rank (for a pipeline: per pipeline micro-batch).
    """

    shape: Shape
    micro_batch: int

    @property
    def layers(self) -> int:
        return self.shape.n_layer

    @property
    def hidden(self) -> int:
        return self.shape.n_embd

    @property
    def seq(self) -> int:
        """Tokens per sequence."""
        return self.shape.seq_len

    @property
    def vocab(self) -> int:
        return self.shape.vocab_size

    @property
    def moe_layers(self) -> int:
        """Routed MoE layers (0: a dense model)."""
        return self.shape.n_moe_layers

    @property
    def n_experts(self) -> int:
        return self.shape.n_experts

    @property
    def top_k(self) -> int:
        return self.shape.top_k

    def tp_params(self, tp: int) -> int:
        """Parameters one tensor-parallel rank holds (``Shape.tp_params``)."""
        return self.shape.tp_params(tp)

    def trainable(self, tp: int = 1) -> int:
        """Parameters one tensor-parallel rank trains (LoRA: its adapters, split as their base layers'; else all)."""
        return self.shape.tp_trainable(tp)

    def nf4(self, dtype_bytes: int, tp: int = 1) -> tuple[int, int]:
        """(elements, bytes all-gathered) of the weights a tensor-parallel rank stores in NF4 (``lora.base=nf4``:
        the adapted linears' base weights, ``states.nf4_bytes`` with scales in ``dtype_bytes``); (0, 0) otherwise."""
        return self.shape.nf4_weights(dtype_bytes, tp, gathered=True)

    def root_params(self, tp: int = 1) -> int:
        """Parameters FSDP leaves to the root (``Shape.root_params``)."""
        return self.shape.root_params(tp)

    def param_tensors(self) -> int:
        """Parameter tensors (``Shape.param_tensors``)."""
        return self.shape.param_tensors()

    def trainable_tensors(self) -> int:
        """Parameter tensors that train (``Shape.trainable_tensors``)."""
        return self.shape.trainable_tensors()

    def activation_bytes(self, dtype_bytes: int) -> int:
        return self.micro_batch * self.seq * self.hidden * dtype_bytes

    @property
    def norm_params(self) -> int:
        """Parameters of one norm (``Shape.norm_params``)."""
        return self.shape.norm_params

    @property
    def colwise(self) -> int:
        """Column-parallel linears per layer, each all-reducing its input gradient in backward (our
        GPT: wq, wk, wv, fc; ``Shape.colwise_inputs``)."""
        return self.shape.colwise_inputs

    @property
    def frozen_first_inputs(self) -> int:
        """Column-parallel linears reading the first block's first norm whose input needs no gradient: with LoRA
        and the embedding frozen, nothing before them trains, so tensor parallelism all-reduces (sequence
        parallelism: reduce-scatters) no input gradient for them (q, k, v: 3; GPT-2's fused c_attn: 1); 0 without
        LoRA."""
        if self.shape.lora is None or not self.shape.lora_units()["embed_frozen"]:
            return 0
        return 1 if self.shape.fused_qkv else 3

    def sp_replicated_grads(self, layers: int, final_norm: bool) -> int:
        """Elements of the replicated parameters whose gradients sequence parallelism leaves partial (their inputs
        are sequence shards) and all-reduces once per step: ``layers`` blocks' two norms and, ``final_norm``, the
        final one; with LoRA the trainable replicated ones instead -- the adapters tensor parallelism does not split
        (colwise: A; rowwise: B) and ``lora.train``'s -- the frozen norms having no gradient."""
        if self.shape.lora is None:
            return (2 * layers + final_norm) * self.norm_params
        lo = self.shape.lora_units()
        return layers * (lo["block_trainable"] - lo["block_trainable_split"])

    @property
    def position_table(self) -> bool:
        """A learned position table (its gradient is gathered from sequence slices under SP); not RoPE's."""
        return self.shape.learned_positions


def _add(out: dict, kind: str, axis: str, nbytes: float) -> None:
    if nbytes:
        out[kind][axis] += int(round(nbytes))


def _pad(n: int, k: int) -> int:
    return -(-n // k) * k


def _tp_activation_comm(out: dict, shape: CommShape, tp: int, b: int, n_forward: int, sp: bool = False) -> None:
    """Tensor parallelism per forward+backward of one micro-batch.

    Without sequence parallelism: forward all-reduces after the embedding and after every rowwise
    linear (wo, proj): 2L + 1; backward all-reduces the input gradient of every colwise linear (wq,
    wk, wv, fc, lm_head): 4L + 1 (``CommShape.colwise`` per layer: 5 with a gated MLP's gate and up,
    2 with GPT-2's fused c_attn); the logits are all-gathered over the vocabulary (B*T*V) -- under the chunked loss
    (``Shape.loss_chunk``) instead three fp32 values per token all-reduced, in forward and in the recompute.

    With it (``parallel/tensor/tensor_parallel.py``): the all-reduces become reduce-scatters onto the sequence
    shard (the embedding's and every rowwise output's, 2L + 1, forward) and all-gathers of it (the
    input of every attention and MLP, once per colwise group, and of the head: 2L + 1, forward), each
    mirrored in backward -- (4L + 2) full activations of each kind; the position table's gradient is
    all-gathered from its sequence slices (T*h) and the logits as before; the LayerNorms' replicated
    gradients are all-reduced once (``reduce_partial_gradients``: per optimizer step; under FSDP, with
    every micro-batch's reduce-scatter). With LoRA's frozen embedding the first block's attention inputs need no
    gradient: their backward collectives are not issued (``CommShape.frozen_first_inputs``), nor under sequence
    parallelism the embedding's and the position table's gathers; the norms' all-reduce becomes the replicated
    adapters' (``sp_replicated_grads``). Without sequence parallelism the replicated adapters' own small
    all-reduces (measured: 1024 B each on gpt_tiny, 36 a step, 2.6% of its bytes) are left out."""
    if tp <= 1:
        return
    a = shape.activation_bytes(b)
    L = shape.layers
    logits = shape.micro_batch * shape.seq * shape.vocab * b
    if shape.shape.loss_chunk:  # the chunked loss is vocabulary-parallel: no logits gathered, but per token three
        # fp32 all-reduces (maximum, sum of exponentials, target logit) in forward and again in the recompute
        _add(out, "all_reduce", "tp", n_forward * shape.micro_batch * shape.seq * 2 * 3 * 4)
        logits = 0
    frozen = shape.frozen_first_inputs  # LoRA: the first block's attention inputs need no gradient
    if not sp:
        _add(out, "all_reduce", "tp", n_forward * ((2 * L + 1) + (shape.colwise * L + 1) - frozen) * a)
        _add(out, "all_gather", "tp", n_forward * logits)
        return
    # (a frozen embedding: neither its output's gradient nor the position table's is gathered back)
    positions = shape.seq * shape.hidden * b * shape.position_table * (not frozen)
    _add(out, "reduce_scatter", "tp", n_forward * (4 * L + 2 - (frozen > 0)) * a)
    _add(out, "all_gather", "tp", n_forward * ((4 * L + 2 - (frozen > 0)) * a + logits + positions))
    _add(out, "all_reduce", "tp", n_forward * shape.sp_replicated_grads(L, True) * b)


def _pipeline_rank(shape: CommShape, pp: int, m: int, b: int, schedule: str, virtual: int, tp: int,
                   rank: int, sp: bool = False) -> dict[str, dict[str, int]]:
    """One pipeline rank's traffic per step. Per micro-batch, a stage sends its output forward and its
    input gradient backward (one activation B_mb*T*h each) to a neighbouring stage on another rank.
    With tp > 1, each of the rank's stages adds the tensor-parallel terms of its own layers (layers
    spread evenly over the stages; the embedding's all-reduce on the first stage, the head's and the
    logits all-gather on the last). With sequence parallelism the activations sent between stages are
    the sequence shard (1/tp), and each stage's TP terms are ``_tp_activation_comm``'s for its layers;
    its LayerNorms' gradients are all-reduced once per step (the schedule accumulates them first)."""
    out: dict = defaultdict(lambda: defaultdict(int))
    n_stages = pp * virtual
    owner = ([min(s, 2 * pp - 1 - s) for s in range(n_stages)] if schedule == "zbv"
             else [s % pp for s in range(n_stages)])
    a = shape.activation_bytes(b)
    L = shape.layers
    for s in (s for s in range(n_stages) if owner[s] == rank):
        for neighbour in (s - 1, s + 1):
            if 0 <= neighbour < n_stages and owner[neighbour] != rank:
                _add(out, "send", "pp", m * a / (tp if sp else 1))
                _add(out, "recv", "pp", m * a / (tp if sp else 1))
        if tp > 1:
            layers = L // n_stages + (1 if s < L % n_stages else 0)
            first, last = s == 0, s == n_stages - 1
            logits = m * shape.micro_batch * shape.seq * shape.vocab * b * last
            if shape.shape.loss_chunk and last:  # vocabulary-parallel chunks (``_tp_activation_comm``)
                _add(out, "all_reduce", "tp", m * shape.micro_batch * shape.seq * 2 * 3 * 4)
                logits = 0
            frozen = shape.frozen_first_inputs if first else 0  # LoRA: no input gradient into the first block
            if sp:
                ends = first + last
                _add(out, "reduce_scatter", "tp", m * (4 * layers + ends - (frozen > 0)) * a)
                _add(out, "all_gather", "tp", m * ((4 * layers + ends - (frozen > 0)) * a + first * shape.seq
                                                   * shape.hidden * b * shape.position_table * (not frozen)) + logits)
                _add(out, "all_reduce", "tp", shape.sp_replicated_grads(layers, bool(last)) * b)
            else:
                _add(out, "all_reduce", "tp", m * ((2 + shape.colwise) * layers + first + last - frozen) * a)
                _add(out, "all_gather", "tp", logits)
    if pp > 1:
        _add(out, "all_reduce", "pp", 4)  # the mean micro-batch loss, shared by every stage (fp32 scalar)
    return out


def _pipeline(out: dict, shape: CommShape, pp: int, m: int, b: int, schedule: str, virtual: int, tp: int,
              stage_rank: int | None, sp: bool = False) -> None:
    """The given pipeline rank's traffic, or (stage_rank None) each collective's largest over the ranks, as
    summary.json's measured ``comm`` takes it (the first stage gathers the position table, the last the logits
    or, under the chunked loss, all-reduces its statistics)."""
    ranks = [stage_rank] if stage_rank is not None else range(pp)
    most: dict = defaultdict(lambda: defaultdict(int))
    for r in ranks:
        for kind, axes in _pipeline_rank(shape, pp, m, b, schedule, virtual, tp, r, sp).items():
            for axis, nbytes in axes.items():
                most[kind][axis] = max(most[kind][axis], nbytes)
    for kind, axes in most.items():
        for axis, nbytes in axes.items():
            _add(out, kind, axis, nbytes)


def step_comm_bytes(strategy: str, *, n_params: int, mesh: dict[str, int], dtype_bytes: int = 4,
                    shape: CommShape | None = None, micro_batches: int = 1, kept_params: int = 0,
                    reshard_after_forward: bool = True, schedule: str = "1f1b", virtual_stages: int = 1,
                    stage_rank: int | None = None, stage_params: int | None = None,
                    sequence_parallel: bool = False, loss_parallel: bool = False,
                    grad_clip: bool = False, expert_params: int = 0,
                    data_parallel: str = "replicate", activation_bytes: int | None = None,
                    recompute: bool | str = False, param_tensors: int | None = None,
                    accumulate: int = 1, grad_sync: str = "every_micro_batch",
                    reduce_dtype_bytes: int | None = None,
                    zero2_collectives: str = "reduce_scatter", float8_params: int = 0,
                    float8_tensors: int = 0, trainable_params: int | None = None,
                    nf4: tuple[int, int] | None = None) -> dict[str, dict[str, int]]:
    """Payload bytes one rank sends through collectives in one optimizer step: ``{kind: {axis: bytes}}``.

    Args:
        strategy: a config name of ``conf/strategy`` (``single``, ``ddp``, ``zero1`` ... ``3d``).
        n_params: Ψ, the model's parameter count (elements).
        mesh: axis -> size (the summary's ``mesh``); missing axes are 1.
        dtype_bytes: bytes per element of the parameters / gradients / activations communicated.
        shape: sizes for activation traffic (tensor and pipeline parallel) and for the parameter
            split FSDP and TP see; needed by ``tensor_parallel``, ``pipeline``, ``fsdp_tp``, ``3d``.
        micro_batches: pipeline micro-batches per step.
        kept_params: parameters FSDP keeps gathered from forward to backward (all-gathered once).
            This repository passes ``reshard_after_forward=True`` explicitly to every ``fully_shard``
            call, root included, so nothing is kept: 0. Under torch's default (None) the root's
            parameters are kept: pass ``shape.root_params()``.
        reshard_after_forward: FSDP re-gathers every unit in backward (ZeRO-3). Without it only the root
            is gathered again in backward (FSDP2 frees the root after forward whatever the flag; measured:
            the root's bytes exactly, ``shape.root_params``; without a shape it is not counted).
        schedule / virtual_stages / stage_rank: pipeline layout; stage_rank None: the busiest rank.
        stage_params: parameters of one pipeline rank's stages (pipeline x data parallel); None:
            n_params / pp.
        grad_clip: zero2's global-norm clipping adds 4 bytes to its per-step all-reduce.
        param_tensors: zero2 all-reduces one 4-byte "got a gradient" count per parameter tensor every step
            (to refuse a parameter no rank used); None: ``shape.param_tensors()``, or 0 without a shape.
        expert_params: expert_parallel: the routed experts' parameters (of ``n_params``), 1/ep per rank.
        data_parallel: expert_parallel's ``replicate`` or ``fsdp`` (FSDP without a dp_shard axis, when ep
            is the whole world, shows in no mesh axis).
        activation_bytes: expert_parallel: bytes per element of the experts' output (2 under bf16
            autocast), which the combine all-to-all and the dispatch's gradient carry; None: ``dtype_bytes``.
        recompute: expert_parallel: activation checkpointing re-runs each MoE layer's forward in backward,
            and with it the dispatch, the combine and the counts' exchange.
        accumulate: micro-batches per optimizer step (``trainer.accumulate_grad_batches``). DDP and
            ZeRO-1 reduce gradients once per step (DDP's ``no_sync``); ZeRO-2 reduce-scatters every
            micro-batch's gradients from its backward hooks (its full gradients never exist, so it cannot
            accumulate them) and all-gathers once; every other strategy communicates in every forward
            and backward: FSDP2 gathers and reduce-scatters per micro-batch, the mesh strategies average
            replicated gradients after every backward, and activations travel per micro-batch.
        grad_sync: FSDP's ``last_micro_batch`` reduces gradients once per step (the reduce-scatter, and
            HSDP's all-reduce over dp_replicate) while its gathers stay per micro-batch.
        reduce_dtype_bytes: FSDP mixed precision's ``reduce_dtype`` (e.g. bf16 gathers with fp32
            reduce-scatters): bytes per element of FSDP's gradient reductions (its reduce-scatters, and
            HSDP's all-reduce over dp_replicate); None: ``dtype_bytes``.
        zero2_collectives: ZeRO-2's ``reduce_scatter`` (+ all-gather) or ``all_reduce`` (+ broadcasts,
            its choice on gloo): ``Zero2Optimizer.collectives``.
        float8_params / float8_tensors: FSDP all-gathers these weights (of ``n_params``; elements, and how
            many tensors) in float8 (``model.float8=tensorwise``, torchao's float8 all-gather): 1 byte each,
            and before every gather of them one 4-byte all-reduce per tensor (the maximum of its shards,
            which sets the shared scale). Measured on gpt_tiny under fsdp x2: exactly these bytes.
        trainable_params: of ``n_params``, those that train (LoRA: the adapters): only their gradients are
            reduced -- DDP's buckets, ZeRO's reduce-scatters, FSDP's reduce-scatter and HSDP's all-reduce hold
            the parameters that require a gradient -- and only they are updated (ZeRO's broadcasts / all-gathers
            of the updated parameters), while FSDP still all-gathers every parameter, frozen ones too. None:
            the shape's (``Shape.trainable``), or every parameter without a shape.
        nf4: (elements, bytes) of ``n_params`` that FSDP gathers as torchao NF4 (QLoRA's base: its packed codes,
            scalers and scales, ``states.nf4_bytes``) instead of ``dtype_bytes`` each; None: the shape's.

    Raises ValueError for a strategy or option this model does not cover.
    """
    if loss_parallel:
        raise ValueError("comm_model: loss_parallel traffic is not modelled")
    try:
        traffic = _TRAFFIC[entry(strategy).comm]  # the catalogue names each strategy's traffic model
    except ValueError:
        raise ValueError(f"comm_model: no communication model for strategy {strategy!r}") from None
    if traffic in _NEEDS_SHAPE and shape is None:
        raise ValueError(f"comm_model: strategy {strategy} needs a shape (activation sizes)")
    get = lambda axis: int(mesh.get(axis, 1))  # noqa: E731
    lora = shape is not None and shape.shape.lora is not None
    if trainable_params is None:
        trainable_params = shape.trainable() if lora else n_params
    if nf4 is None:
        nf4 = shape.nf4(dtype_bytes) if lora else (0, 0)
    step = _Step(defaultdict(lambda: defaultdict(int)), n_params, dtype_bytes, shape, get("dp_replicate"),
                 get("dp_shard"), get("tp"), get("pp"), get("ep"), micro_batches, kept_params, reshard_after_forward,
                 schedule, virtual_stages, stage_rank, stage_params, grad_clip, expert_params, data_parallel,
                 activation_bytes, recompute, param_tensors, sequence_parallel, max(1, int(accumulate)),
                 zero2_collectives, float8_params, float8_tensors, int(trainable_params), nf4)
    traffic(step)
    k = max(1, int(accumulate))

    def times(kind: str, axis: str) -> int:
        if traffic in _ONCE_PER_STEP:  # (ZeRO-2 counts its per-micro-batch reductions itself)
            return 1
        once = grad_sync == "last_micro_batch" and (kind == "reduce_scatter" or (kind, axis) == ("all_reduce", "dp_replicate"))
        # sequence parallelism's only tp all-reduce is the LayerNorms' gradients: FSDP2 reduces them with
        # every micro-batch's reduce-scatter, the strategy itself once per step (``optimizer_step``)
        once = once or (sequence_parallel and traffic is not _fsdp_tp and (kind, axis) == ("all_reduce", "tp"))
        return 1 if once else k

    def reduced(kind: str, axis: str) -> float:
        if reduce_dtype_bytes is None or axis in ("tp", "pp", "ep"):
            return 1.0
        fsdp_reduce = kind == "reduce_scatter" or (traffic is _fsdp and (kind, axis) == ("all_reduce", "dp_replicate"))
        return reduce_dtype_bytes / dtype_bytes if fsdp_reduce else 1.0

    return {kind: {axis: int(round(nbytes * reduced(kind, axis))) * times(kind, axis) for axis, nbytes in axes.items()}
            for kind, axes in step.out.items() if any(axes.values())}


@dataclass
class _Step:
    """``step_comm_bytes``'s arguments, and the bytes counted so far (``out``)."""

    out: dict
    P: int
    b: int
    shape: CommShape | None
    rep: int
    shard: int
    tp: int
    pp: int
    ep: int
    micro_batches: int
    kept_params: int
    reshard_after_forward: bool
    schedule: str
    virtual_stages: int
    stage_rank: int | None
    stage_params: int | None
    grad_clip: bool
    expert_params: int
    data_parallel: str
    activation_bytes: int | None
    recompute: bool | str
    param_tensors: int | None
    sequence_parallel: bool = False
    accumulate: int = 1
    zero2_collectives: str = "reduce_scatter"
    float8_params: int = 0
    float8_tensors: int = 0
    T: int = 0  # of P, the parameters that train (LoRA: the adapters)
    nf4: tuple[int, int] = (0, 0)  # of P, (elements, bytes) gathered in NF4

    def trained(self, params: int) -> int:
        """Of ``params`` (a share of the model: a tp rank's, a stage's), those that train."""
        return params if self.T >= self.P else int(round(params * self.T / self.P)) if self.P else 0

    def fsdp(self, params: int, kept: int, axis: str, reshard: bool, root: int = 0, tp: int = 1,
             trainable: int | None = None) -> None:
        """FSDP over ``axis``: gathered in forward and again in backward (``reshard``; ``kept`` only
        once), or once and the root (``root`` parameters) again; reduce-scattered once: the gradients of
        ``trainable`` of them (None: all). Weights gathered in float8 (in the blocks, never the root) travel
        at 1 byte, after an all-reduce of their scale; QLoRA's NF4 weights (in the blocks) as NF4; ``tp``:
        the parameters are this tp rank's split (each weight in part, every weight's scale reduced)."""
        if self.shard <= 1:
            return
        # of the float8 weights, this call's part of the model (a pipeline stage's); tp splits each of them
        part = min(1.0, (params / self.P if self.P else 0.0) * tp)
        f8 = int(round(self.float8_params * part / tp))
        f8_tensors = int(round(self.float8_tensors * part))
        gathers = 2 if reshard else 1
        # NF4: the stage's share, each gathered as its bytes instead of b per element (never kept or in the root)
        nf4_saved = part * (self.nf4[0] * self.b - self.nf4[1]) / tp if self.nf4[0] else 0.0
        _add(self.out, "all_gather", axis, (2 * params - kept if reshard else params + root) * self.b
             - gathers * f8 * (self.b - 1) - gathers * nf4_saved)
        if f8_tensors:
            _add(self.out, "all_reduce", axis, gathers * 4 * f8_tensors)
        _add(self.out, "reduce_scatter", axis, (params if trainable is None else trainable) * self.b)

    def root(self, tp: int = 1) -> int:
        return self.shape.root_params(tp) if self.shape is not None else 0


def _none(s: _Step) -> None:
    """One device: nothing to communicate."""


def _all_reduce(s: _Step) -> None:
    """DDP: every gradient all-reduced once (bucketed): the trainable parameters'."""
    _add(s.out, "all_reduce", "dp_replicate", s.T * s.b * (s.rep * s.shard > 1))


def _zero1(s: _Step) -> None:
    n = s.rep * s.shard
    _add(s.out, "all_reduce", "dp_shard", s.T * s.b * (n > 1))  # DDP's gradient buckets
    _add(s.out, "broadcast", "dp_shard", s.T * s.b * (n > 1))  # every owner broadcasts its updated params


def _zero2(s: _Step) -> None:
    """Every micro-batch's gradients reduced from backward hooks (their bucket padding is left out: at
    most N - 1 elements a bucket); the parameters gathered once per step."""
    if s.shard > 1:
        if s.zero2_collectives not in ("reduce_scatter", "all_reduce"):
            raise ValueError(f"comm_model: zero2_collectives {s.zero2_collectives!r} is not modelled")
        reduce, gather = ("all_reduce", "broadcast") if s.zero2_collectives == "all_reduce" \
            else ("reduce_scatter", "all_gather")
        # its flat buffer holds the optimizer's parameters: the trainable ones
        _add(s.out, reduce, "dp_shard", _pad(s.T, s.shard) * s.b * s.accumulate)
        _add(s.out, gather, "dp_shard", _pad(s.T, s.shard) * s.b)
        flags = s.param_tensors if s.param_tensors is not None else (s.shape.trainable_tensors() if s.shape else 0)
        _add(s.out, "all_reduce", "dp_shard", 4 * (flags + s.grad_clip))


def _fsdp(s: _Step) -> None:
    s.fsdp(s.P, s.kept_params, "dp_shard", s.reshard_after_forward, s.root(), trainable=s.T)
    if s.rep > 1:  # HSDP: the reduce-scattered shard is all-reduced across replicas
        _add(s.out, "all_reduce", "dp_replicate", s.T / s.shard * s.b)


def _tensor_parallel(s: _Step) -> None:
    _tp_activation_comm(s.out, s.shape, s.tp, s.b, 1, s.sequence_parallel)
    _add(s.out, "all_reduce", "dp_replicate", s.shape.trainable(s.tp) * s.b * (s.rep > 1))


def _fsdp_tp(s: _Step) -> None:
    _tp_activation_comm(s.out, s.shape, s.tp, s.b, 1, s.sequence_parallel)
    s.fsdp(s.shape.tp_params(s.tp), s.kept_params, "dp_shard", s.reshard_after_forward, s.root(s.tp), tp=s.tp,
           trainable=s.shape.trainable(s.tp))


def _pipeline_dp(s: _Step, tp: int | None) -> None:
    """A pipeline rank's sends and receives, then its stages' gradients over the data axis: FSDP over
    dp_shard (no re-gather per micro-batch under a pipeline) or all-reduced over dp_replicate.
    ``tp`` None: no tensor parallelism in the layout (the parameters are Ψ, not the TP split)."""
    _pipeline(s.out, s.shape, s.pp, s.micro_batches, s.b, s.schedule, s.virtual_stages, tp or 1, s.stage_rank,
              s.sequence_parallel)
    mine = s.stage_params if s.stage_params is not None else (s.shape.tp_params(tp) if tp else s.P) // s.pp
    trained = s.trained(mine) if tp is None else (
        mine if s.T >= s.P else int(round(mine * s.shape.trainable(tp) / max(1, s.shape.tp_params(tp)))))
    s.fsdp(mine, 0, "dp_shard", False, trainable=trained)
    _add(s.out, "all_reduce", "dp_replicate", trained * s.b * (s.rep > 1))
    tied = s.shape.shape.units().get("tied", 0) if s.shape is not None else 0  # a Hugging Face tied head
    if tied and s.pp > 1:  # the first and last stages sum their copies' gradients (parallel/pipeline/stage_ties.py)
        _add(s.out, "all_reduce", "pp", tied // (tp or 1) // max(1, s.shard) * s.b)


def _pipeline_only(s: _Step) -> None:
    _pipeline_dp(s, None)


def _3d(s: _Step) -> None:
    _pipeline_dp(s, s.tp)


def _expert(s: _Step) -> None:
    _expert_parallel(s.out, s.shape, s.P, s.expert_params, s.ep, s.rep, s.shard, s.b,
                     fsdp=s.data_parallel == "fsdp", act_b=s.b if s.activation_bytes is None else s.activation_bytes,
                     recompute=s.recompute)


#: the traffic models a catalogue entry may name (``StrategyEntry.comm``)
_TRAFFIC: dict[str, Callable[[_Step], None]] = {
    "none": _none, "all_reduce": _all_reduce, "zero1": _zero1, "zero2": _zero2, "fsdp": _fsdp,
    "tensor_parallel": _tensor_parallel, "fsdp_tp": _fsdp_tp, "pipeline": _pipeline_only, "3d": _3d,
    "expert_parallel": _expert}
_NEEDS_SHAPE = (_tensor_parallel, _fsdp_tp, _pipeline_only, _3d)
_ONCE_PER_STEP = (_none, _all_reduce, _zero1, _zero2)
TRAFFIC_MODELS = tuple(_TRAFFIC)


def _expert_parallel(out: dict, shape: CommShape | None, P: int, experts: int, ep: int, rep: int, shard: int,
                     b: int, fsdp: bool = False, act_b: int = 4, recompute: bool | str = False) -> None:
    """strategies/expert_parallel.py. Per MoE layer and forward: the routed rows go out in one
    all-to-all and come back in another (payload: this rank's ``tokens x top_k`` rows of ``hidden``
    elements each, under dropless routing), after an all-to-all of the per-expert counts (int64);
    backward reverses both row exchanges. The non-expert gradients are averaged over the whole
    world (ep is a data axis), the experts' over the data axis beside ep: all-reduced (``replicate``)
    or, under FSDP, all-gathered twice and reduce-scattered (non-expert parameters over the world,
    each rank's 1/ep of the experts over dp_shard; with ep the whole world there is no dp_shard and
    the experts, outside FSDP, are not communicated)."""
    if shape is None or not shape.moe_layers:
        raise ValueError("comm_model: expert_parallel needs an MoE shape (moe_layers, n_experts, top_k)")
    if ep > 1:
        rows = shape.micro_batch * shape.seq * shape.top_k
        # dispatch and combine, forward and backward: twice in the input's dtype, twice in the output's;
        # a recomputed forward exchanges its rows and counts once more (full or selective checkpointing: the
        # all-to-all is not a matmul, so selective recomputes it too)
        forward = rows * shape.hidden * (b + act_b) + 8 * shape.n_experts
        # (every k-th block checkpointed: only the MoE blocks among them)
        again = recomputed_moe_layers(shape.layers, shape.shape.moe_every, recompute) if shape.moe_layers else 0
        _add(out, "all_to_all", "ep", shape.moe_layers * (2 * forward - 8 * shape.n_experts) + again * forward)
    # the non-expert parameters' group: every data rank (strategies/expert_parallel.py flattens the
    # data axes into one mesh); named ``world`` like callbacks/comm.py names a group of every rank
    on = [name for name, size in (("dp_replicate", rep), ("dp_shard", shard), ("ep", ep)) if size > 1]
    world_axis = "world" if len(on) > 1 else (on[0] if on else "ep")
    dense, local_experts = P - experts, experts // ep
    if shard > 1 or fsdp:  # FSDP: non-expert over the world, experts over dp_shard
        _add(out, "all_gather", world_axis, 2 * dense * b)
        _add(out, "reduce_scatter", world_axis, dense * b)
        if shard > 1:
            _add(out, "all_gather", "dp_shard", 2 * local_experts * b)
            _add(out, "reduce_scatter", "dp_shard", local_experts * b)
    else:
        _add(out, "all_reduce", world_axis, dense * b * (rep * ep > 1))
        _add(out, "all_reduce", "dp_replicate", local_experts * b * (rep > 1))


def total_bytes(comm: dict[str, dict[str, int]]) -> int:
    """Sum of every kind and axis."""
    return sum(sum(axes.values()) for axes in comm.values())


def predicted_seconds(comm: dict[str, dict[str, int]], mesh: dict[str, int], bandwidth_gbs: dict[str, float]) -> float:
    """Lower bound on communication time: payload x bus factor / link bandwidth (GB/s per axis;
    a missing axis uses ``bandwidth_gbs['default']``), summed over kinds and axes, no overlap."""
    t = 0.0
    for kind, axes in comm.items():
        for axis, nbytes in axes.items():
            n = int(mesh.get(axis, 2))
            bw = bandwidth_gbs.get(axis, bandwidth_gbs.get("default", 0.0))
            if bw > 0:
                t += nbytes * bus_factor(kind, n) / (bw * 1e9)
    return t
