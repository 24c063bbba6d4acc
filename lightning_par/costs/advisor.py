"""Strategy advisor: which strategy for this model on this cluster, and the command that runs it.

Every candidate plan is priced three ways, at the same global batch (sequences per optimizer step):

- memory, by the cost model (``lightning_par.costs.estimate``: the per-rank *peak* of a step, activations and
  transients included; offloaded states in host memory, per node);
- communication, by ``lightning_par.costs.comm`` (payload bytes per step and rank, by collective and
  mesh axis; time = bytes x bus factor / link bandwidth, the within-node bandwidth for axes inside a
  node and the between-node one for axes that span nodes);
- step time, by ``lightning_par.costs.step_time``: compute (model FLOPs of the rank's share at an
  efficiency of the device peak, recomputation included) + the communication not hidden behind
  compute + the pipeline bubble + the offloaded optimizer step; and the MFU that implies.

A plan "fits" when its peak is within ``headroom`` of device memory and, when ``host_memory_gb`` is
stated, its offloaded states are within ``headroom`` of a node's host memory. **Among the plans that
fit, the one with the least predicted step time wins** (within 2% of each other, the catalogue's
preference decides: the less machinery). The advisor never recommends a plan that does not fit (it
says so and exits non-zero instead).

The candidates are the strategy catalogue's (``strategies/catalog.py``: ``StrategyEntry.advise``), and
for each of them the variants a practitioner would try:

- the micro-batch size: the given one and larger ones up to what the batch allows (fewer, larger
  micro-batches re-gather FSDP units less often and have larger pipeline bubbles);
- gradient accumulation, or the pipeline's micro-batch count, to reach the global batch;
- FSDP mixed precision for every FSDP-sharded plan under ``bf16-mixed``: parameters gathered in bf16,
  gradients reduced in fp32 (``strategy.param_dtype=bf16 strategy.reduce_dtype=fp32``);
- sequence parallelism for tensor-parallel plans, the interleaved 1F1B schedule for pipelines;
- 8-bit optimizer states (torchao's AdamW8bit) on one device, and for every plan when none fits with
  fp32 states; CPU offload (``zero3_offload``); and when nothing else fits, memory-centric tiling
  (``strategy.tiling``) of every block linear, the head and the embedding.

Models: our GPT and MoE presets (or a parameter count with its layers and width, built as a GPT, or
as a Llama / Qwen2 with the sizes given), the Hugging Face decoders of ``conf/model`` (``hf_llama_1b``,
``hf_qwen2_0p5b``, ...), and any transformers config of those families (a ``config.json``, a
``save_pretrained`` directory): grouped-query attention, gated MLPs, RMSNorm, tied embeddings, biases,
priced from the transformers model itself, built on the meta device, so the count is transformers'
own. Every answer says what it priced (``describe``) and how close its peak is to the limit. A plan is
offered for a Hugging Face model only where its strategies can run it (``_hf_refusal``: tensor
parallelism by the model's own tp_plan and the sizes it must divide, no sequence parallelism unless
the plan names its norms, a pipeline only by a pipeline plan), and its tiling paths are the model's.

Mixture-of-experts models add expert parallelism (``expert_parallel``, ep = the largest divisor of
the expert count within a node, the rest replicated or FSDP); its all-to-all of the routed tokens is
on the critical path, the experts' gradient reduction it saves is not. The cost model does not price
tensor parallelism of an MoE model (its MoE layers run whole on every tp rank), so fsdp_tp / 3d are
not offered for it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_par.costs import comm as comm_model
from lightning_par.costs.activations import dtypes
from lightning_par.costs.counting import block_linears, hf_model, hf_plan, module_paths
from lightning_par.costs.shape import Shape
from lightning_par.costs.step_time import Device, StepTime, step_time
from lightning_par.costs.estimate import GIB, MemoryEstimate, bytes_per_param, estimate, layout
from lightning_par.strategies.catalog import CATALOG, Fleet, Layout, Option, StrategyEntry

TILES = (2, 4, 8, 16, 32, 64)
MICRO_STEPS = (1, 2, 4, 8, 16)  # micro-batch sizes tried: the given one times these
TIE = 0.02  # step times within 2% of the fastest are a tie, broken by the catalogue's preference
NEAR = 0.05  # a plan whose peak is within 5% of the usable memory is said to be close to the limit
#: the console script the printed command starts with (pyproject.toml [project.scripts])
PROGRAM = "lightning-par"
#: what an option of the printed command needs installed: (word prefix, extra, what for)
EXTRAS = (("model=hf_", "hf", "transformers, for the Hugging Face model"),
          ("model.optimizer=adamw8bit", "optim8bit", "torchao, for model.optimizer=adamw8bit (AdamW8bit)"),
          ("model.lora.base=nf4", "lora", "torchao, for model.lora.base=nf4 (QLoRA's NF4 base)"))
#: ``--finetune``: LoRA's default rank and alpha (PEFT's and torchtune's recipes: alpha = 2 x rank)
LORA_RANK = 16
#: ``--finetune``: a method that trains more (full fine-tuning, then LoRA, then QLoRA) is chosen when its plan fits and
#: its predicted step is at most this many times the fastest plan of the methods that train less
REASONABLE = 2.0


#: where the advisor's disk-tier command puts the files (a node-local NVMe mount: edit to yours)
NVME_DIR = "/local_nvme/lightning_par"
#: share of the stated NVMe the disk tier may fill
NVME_HEADROOM = 0.9


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    devices_per_node: int = 8
    device_memory_gb: float = 80.0  # GiB per device
    intra_node_gbs: float = 300.0  # GB/s per device within a node (NVLink-class)
    inter_node_gbs: float = 25.0  # GB/s per device between nodes (InfiniBand-class; Ethernet: ~3)
    peak_tflops: float = 989.0  # dense bf16 TFLOP/s per device (H100 SXM)
    efficiency: float = 0.5  # fraction of the peak a training step reaches (the CLI: measured.py's, by device class)
    host_link_gbs: float = 25.0  # device <-> host GB/s per device (offload)
    host_memory_gb: float | None = None  # GiB of host memory per node; None: not stated (not checked)
    nvme_gb: float | None = None  # GiB of local disk (NVMe) per node for the disk tier; None: no disk tier
    nvme_gbs: float = 3.0  # GB/s the node's NVMe reads and writes, shared by its ranks (one PCIe 4 drive: 3-7)
    float8_tflops: float | None = 1979.0  # dense float8 TFLOP/s per device (None: no float8 matmuls)

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def device(self) -> Device:
        return Device(self.peak_tflops, self.efficiency, self.host_link_gbs, float8_tflops=self.float8_tflops)


@dataclass
class Candidate:
    strategy: str
    overrides: list[str]
    memory: MemoryEstimate
    comm_bytes: int
    comm_seconds: float
    fits: bool
    global_batch: int = 1
    time: StepTime | None = None
    micro: int = 1  # sequences per forward on one rank
    steps: int = 1  # forwards per optimizer step: accumulated, or the pipeline's micro-batches
    host_bytes: int = 0  # offloaded states per node
    preference: int = 0
    disk_bytes: int = 0  # the disk tier's files per node
    checkpointing: bool | str = False  # activation checkpointing: False, True (full) or "selective"
    #: the same plan's peak without checkpointing, where that did not fit and this one checkpoints
    peak_without_checkpointing: int | None = None

    @property
    def seconds(self) -> float:
        return self.time.total if self.time is not None else float("inf")

    @property
    def label(self) -> str:
        o = self.overrides
        extra = "x".join(w.split("=", 1)[1] for w in o if w.startswith(("strategy.tp=", "strategy.pp=")))
        if self.strategy == "expert_parallel":  # e.g. "expert_parallel (ep8, fsdp)"
            extra = ", ".join([f"ep{w.split('=', 1)[1]}" for w in o if w.startswith("strategy.ep=")] + [
                w.split("=", 1)[1] for w in o if w.startswith("strategy.data_parallel=")])
        flags = [name for key, name in (("tiling", "tiled"), ("model.optimizer=adamw8bit", "8-bit"),
                                        ("strategy.offload_dir=", "disk"),
                                        ("strategy.sequence_parallel=true", "sp"),
                                        ("strategy.schedule=interleaved_1f1b", "interleaved"),
                                        ("strategy.param_dtype=bf16", "bf16-gather"))
                 if any(key in w for w in o)]
        return " ".join([self.strategy, *flags]) + (f" ({extra})" if extra else "")


@dataclass
class Advice:
    strategy: str | None
    overrides: list[str]
    reasons: list[str]
    per_device_bytes: int
    candidates: list[Candidate] = field(default_factory=list)
    model_overrides: list[str] = field(default_factory=list)
    precision: str = "bf16-mixed"
    chosen: Candidate | None = None
    shape: Shape | None = None  # the model priced
    cluster: Cluster | None = None
    budget: float = 0.0  # usable bytes per device (headroom x device memory)
    host_budget: float | None = None  # usable host bytes per node, where stated
    #: ``--finetune``: every method weighed, (its name, its advice), full fine-tuning first; this one among them
    methods: list[tuple[str, Advice]] = field(default_factory=list)

    @property
    def method(self) -> str:
        """``full fine-tuning``, ``LoRA rank r`` or ``QLoRA rank r`` (the priced shape's ``lora``)."""
        return method_name(self.shape)

    def headline(self) -> str:
        """``Recommended: <the chosen row's label>`` (e.g. ``single 8-bit``), or that nothing fits; a fine-tune
        (``methods``) adds the method (``single (QLoRA rank 16)``)."""
        if self.chosen is None:
            return "Recommended: nothing fits"
        return f"Recommended: {self.chosen.label}" + (f" ({self.method})" if self.methods else "")

    def methods_table(self) -> str:
        """``--finetune``: each method's fastest plan that fits -- its peak per device, host memory, predicted step
        and trainable parameters -- or that none fits (``Advice.methods``)."""
        head = f"{'method':<34}{'trainable':>16}  {'plan':<28}{'peak GiB':>9}{'host GiB':>9}{'step s':>9}"
        lines = [head, "-" * len(head)]
        for name, a in self.methods:
            mark = "> " if a is self else "  "
            trains = a.shape.trainable() if a.shape is not None else 0
            c = a.chosen
            mark_ckpt = {True: " +ckpt", "selective": " +sel"}.get(c.checkpointing, "") if c else ""
            plan = c.label + mark_ckpt if c else "nothing fits"
            figures = f"{c.memory.peak / GIB:>9.2f}{c.host_bytes / GIB:>9.1f}{c.seconds:>9.3f}" if c else ""
            lines.append(f"{mark + name:<34}{trains:>16,}  {plan:<28}{figures}")
        return "\n".join(lines)

    def command(self) -> str:
        """The complete command: strategy, model, data and trainer overrides, each word quoted for a
        POSIX shell where it must be (a tiling plan's braces and commas, a path's spaces)."""
        if self.strategy is None:
            return ""
        words = [f"strategy={self.strategy}", *self.model_overrides, f"trainer.precision={self.precision}",
                 *self.overrides]
        return " ".join([PROGRAM, *(shlex.quote(w) for w in words)])

    def extras(self) -> list[tuple[str, str]]:
        """(extra, what for) of every ``lightning_par[extra]`` an option of the command needs."""
        words = [*self.model_overrides, *self.overrides] if self.strategy else []
        return [(extra, why) for prefix, extra, why in EXTRAS if any(w.startswith(prefix) for w in words)]

    def install(self) -> str:
        """The ``pip install`` line of ``extras`` ("" where the command needs none)."""
        extras = self.extras()
        if not extras:
            return ""
        return (f"pip install 'lightning_par[{','.join(dict.fromkeys(e for e, _ in extras))}]'  ("
                + "; ".join(why for _, why in extras) + ")")

    def memory_line(self) -> str:
        """The chosen plan's peak against the usable memory, and the margin; within ``NEAR`` of the
        limit it says so. Host memory too where the plan offloads."""
        c, gib = self.chosen, (lambda b: b / GIB)  # noqa: E731
        if c is None:
            return ""
        margin = self.budget - c.memory.peak
        device = (f" ({self.budget / (self.cluster.device_memory_gb * GIB):.0%} of {self.cluster.device_memory_gb:g} "
                  "GiB)") if self.cluster else ""
        line = (f"Memory: peak {gib(c.memory.peak):.2f} GiB per device of {gib(self.budget):.2f} GiB usable{device}, "
                f"margin {gib(margin):.2f} GiB ({margin / self.budget:.1%} of the limit)")
        if margin < NEAR * self.budget:
            line += (f"; WITHIN {NEAR:.0%} OF THE LIMIT: the allocator's fragmentation, a longer sequence or a "
                     "larger micro-batch can tip it over")
        if c.host_bytes:
            if self.host_budget:
                host_margin = self.host_budget - c.host_bytes
                line += (f"; host {gib(c.host_bytes):.1f} GiB per node of {gib(self.host_budget):.1f} GiB usable, "
                         f"margin {gib(host_margin):.1f} GiB ({host_margin / self.host_budget:.1%})")
                if host_margin < NEAR * self.host_budget:
                    line += f", within {NEAR:.0%} of the host's limit"
            else:
                line += f"; host {gib(c.host_bytes):.1f} GiB per node (host memory not stated: --host-memory)"
        if c.disk_bytes and self.cluster is not None and self.cluster.nvme_gb:
            disk_budget = self.cluster.nvme_gb * GIB * NVME_HEADROOM
            line += (f"; disk {gib(c.disk_bytes):.1f} GiB per node of {gib(disk_budget):.1f} GiB usable, margin "
                     f"{gib(disk_budget - c.disk_bytes):.1f} GiB")
        return line

    def table(self, budget: float, per_strategy: int = 3) -> str:
        """The chosen plan, the others that fit, fastest first, then those that do not; at most
        ``per_strategy`` variants of each strategy (each at its fastest fitting micro-batch, else its smallest peak)."""
        head = (f"{'candidate':<40}{'mb x n':>8}{'peak GiB':>10}{'host GiB':>10}{'fits':>6}"
                f"{'comm GB/step':>14}{'comm s/step':>13}{'step s':>9}{'MFU':>7}")
        lines = [head, "-" * len(head)]
        shown: dict[str, int] = {}
        rows = [c for c in sorted(self.candidates, key=lambda c: (c is not self.chosen, not c.fits, c.seconds))
                if (shown.__setitem__(c.strategy, shown.get(c.strategy, 0) + 1) or shown[c.strategy]) <= per_strategy]
        for c in rows:
            m, t = c.memory, c.time
            step = f"{t.total:>9.3f}{100 * t.mfu:>6.1f}%" if t is not None else f"{'-':>9}{'-':>7}"
            label = c.label + {True: " +ckpt", "selective": " +sel"}.get(c.checkpointing, "")
            lines.append(f"{label:<40}{f'{c.micro}x{c.steps}':>8}{m.peak / GIB:>10.2f}{c.host_bytes / GIB:>10.1f}"
                         f"{'yes' if c.fits else 'NO':>6}{c.comm_bytes / 1e9:>14.2f}{c.comm_seconds:>13.3f}{step}")
        more = len(self.candidates) - len(rows)
        return "\n".join(lines + [f"(fits: peak <= {budget / GIB:.1f} GiB usable per device; mb x n: sequences "
                                  "per micro-batch x micro-batches per step; +ckpt / +sel: full / selective activation checkpointing; "
                                  "host GiB: offloaded states per node"
                                  + (f"; {more} slower variants not shown" if more else "") + ")"])


#: the activation each Hugging Face architecture's config defaults to (models/hf/causal_lm.py leaves it)
_HF_DEFAULT_ACT = {"gpt2": "gelu_new", "llama": "silu", "qwen2": "silu"}


def hydra_value(value: Any) -> str:
    """``value`` in Hydra's override grammar: bool, null, numbers, quoted strings, lists, dicts."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        if re.fullmatch(r"[A-Za-z_/][\w/.+-]*", value) and value.lower() not in ("true", "false", "null", "inf",
                                                                                 "nan"):
            return value
        # Hydra's quoted strings unescape a backslash only before a quote (and the closing quote)
        quoted = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
        return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, quoted) + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        for k in value:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k)):
                raise ValueError(f"a config field's key {k!r} cannot be written as a Hydra override")
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"a config value of type {type(value).__name__} cannot be written as a Hydra override")


def model_overrides(shape: Shape, preset: str | None, global_batch: int, pretrained: str | None = None) -> list[str]:
    """Overrides that build exactly ``shape`` and feed it ``global_batch`` sequences per step:
    ``model=<preset>``, a ``save_pretrained`` directory (``model.pretrained``: its config and weights),
    or the model's sizes and further config fields (``hf_causal_lm``'s ``+model.config.<field>``; our
    GPT's fields)."""
    if pretrained:
        out = ["model=hf_causal_lm", f"model.pretrained={hydra_value(pretrained)}"]
    elif preset:
        out = [f"model={preset}"]
    elif shape.hf:  # conf/model/hf_causal_lm.yaml's fields (models/hf/causal_lm.py)
        out = ["model=hf_causal_lm", f"model.arch={shape.hf_arch}", f"model.hidden={shape.n_embd}",
               f"model.layers={shape.n_layer}", f"model.heads={shape.n_head}",
               f"model.kv_heads={shape.kv_heads or 'null'}", f"model.intermediate={shape.inner}",
               f"model.vocab={shape.vocab_size}", f"model.max_positions={shape.block_size or shape.seq_len}",
               f"model.tie_word_embeddings={str(shape.tied).lower()}"]
        if shape.hidden_act != _HF_DEFAULT_ACT.get(shape.hf_arch):
            key = "activation_function" if shape.hf_arch == "gpt2" else "hidden_act"
            out.append(f"+model.config.{key}={shape.hidden_act}")
        out += [f"+model.config.{k}={hydra_value(v)}" for k, v in shape.hf_fields.items()]
    else:
        out = ["model=gpt_small", "model.preset=null", f"+model.n_layer={shape.n_layer}",
               f"+model.n_embd={shape.n_embd}", f"+model.n_head={shape.n_head}",
               f"+model.vocab_size={shape.vocab_size}", f"+model.block_size={shape.block_size or shape.seq_len}",
               f"+model.mlp_ratio={shape.mlp_ratio}", f"+model.bias={str(shape.bias).lower()}"]
    return out + lora_overrides(shape) + [f"data.seq_len={shape.seq_len}", f"data.global_batch_size={global_batch}"]


def lora_overrides(shape: Shape) -> list[str]:
    """The ``model.lora`` overrides of ``shape.lora`` (none without it): rank and alpha, the NF4 base, targets,
    dropout and trained modules where they are not the defaults."""
    lo = shape.lora
    if lo is None:
        return []
    from lightning_par.parallel.adapters.lora import DEFAULT_TARGETS

    alpha = int(lo.alpha) if float(lo.alpha).is_integer() else lo.alpha
    out = [f"model.lora.rank={lo.rank}", f"model.lora.alpha={hydra_value(alpha)}"]
    if lo.base != "none":
        out.append(f"model.lora.base={lo.base}")
    if tuple(lo.targets) != DEFAULT_TARGETS:
        out.append(f"model.lora.targets={hydra_value(list(lo.targets))}")
    if lo.dropout:
        out.append(f"model.lora.dropout={hydra_value(lo.dropout)}")
    if lo.train:
        out.append(f"model.lora.train={hydra_value(list(lo.train))}")
    return out


def method_name(shape: Shape | None) -> str:
    """``full fine-tuning``, ``LoRA rank r`` or ``QLoRA rank r`` (an NF4 base) of ``shape.lora``."""
    lo = shape.lora if shape is not None else None
    if lo is None:
        return "full fine-tuning"
    return f"{'QLoRA' if lo.base == 'nf4' else 'LoRA'} rank {lo.rank}"


def describe(shape: Shape) -> list[str]:
    """What was priced, in two lines: the parameter count (``Shape.units``: counted from the model
    itself on the meta device) by part, and the architecture's sizes and sequence length."""
    u = shape.units()
    layers = (f"{shape.n_layer} layers x {u['block']:,}" if not shape.n_moe_layers else
              f"{shape.n_moe_layers} MoE layers x {u['moe_block']:,} + {shape.n_layer - shape.n_moe_layers} dense x "
              f"{u['block']:,}")
    tied = u.get("tied", 0)
    count = (f"{u['total']:,} parameters (embedding {u['embed']:,} + {layers} + head {u['head']:,}"
             + (f", {tied:,} of them the table shared with the embedding" if tied else "") + ")")
    if shape.n_moe_layers:
        count += f"; {shape.n_moe_layers * u['moe_experts']:,} in routed experts"
    attention = (f"{shape.n_head} attention heads, {shape.n_kv_heads} key/value heads (grouped-query)"
                 if shape.n_kv_heads != shape.n_head else f"{shape.n_head} attention heads (full multi-head)")
    if shape.hf:
        from lightning_par.costs.counting import hf_model

        what = f"{shape.hf_arch} ({type(hf_model(shape)).__name__})"
        mlp = f"{'gated ' if shape.gated_mlp else ''}MLP {shape.inner} ({shape.hidden_act})"
        norms = "RMSNorm" if shape.rms_norm else "LayerNorm"
    else:
        what = "GPT (models/moe.py)" if shape.n_experts else "GPT (models/gpt.py)"
        mlp = f"MLP {shape.inner} ({shape.mlp_ratio} x hidden, gelu)"
        norms = "LayerNorm" + (" with biases" if shape.bias else ", no biases")
    parts = [f"{shape.n_layer} layers", f"hidden {shape.n_embd}", attention, mlp]
    if shape.n_experts:
        parts.append(f"{shape.n_experts} experts of MLP {shape.moe_hidden}, top-{shape.top_k}, every "
                     f"{'' if shape.moe_every == 1 else f'{shape.moe_every}th '}layer"
                     + (" + a shared expert" if shape.shared_expert else ""))
    parts += [f"vocabulary {shape.vocab_size}", f"{'tied' if shape.tied else 'untied'} head", norms,
              f"learned positions ({shape.block_size or shape.seq_len})" if shape.learned_positions
              else f"rotary positions (up to {shape.block_size or shape.seq_len})"]
    parts += [f"{k}={v}" for k, v in shape.hf_fields.items()]
    out = [count, f"{what}: {', '.join(parts)}; {shape.seq_len}-token sequences"]
    if shape.lora is not None:
        lo = shape.lora_units()
        out.append(f"{method_name(shape)} (alpha {shape.lora.alpha:g}): {lo['trainable']:,} trainable parameters "
                   f"({lo['trainable'] / u['total']:.2%}), adapters on {len(lo['linears'])} linears of every layer; the "
                   + ("adapted linears' base weights in NF4, the rest frozen in the training dtype"
                      if shape.lora.base == "nf4" else "rest frozen (weights only: no gradients, no optimizer states)"))
    return out


def _axis_bandwidth(mesh: dict[str, int], cluster: Cluster) -> dict[str, float]:
    """GB/s of each mesh axis: within a node when the axis and the axes inside it fit in one node."""
    out, inner = {}, 1
    for axis in ("tp", "ep", "dp_shard", "dp_replicate", "pp"):  # innermost first (parallel/mesh.py)
        inner *= mesh.get(axis, 1)
        out[axis] = cluster.intra_node_gbs if inner <= cluster.devices_per_node else cluster.inter_node_gbs
    out["world"] = cluster.intra_node_gbs if inner <= cluster.devices_per_node else cluster.inter_node_gbs
    return out


@dataclass(frozen=True)
class _Ask:
    """What every candidate of one question shares."""

    shape: Shape
    cluster: Cluster
    budget: float
    host_budget: float | None
    global_batch: int
    precision: str
    optimizer: str
    checkpointing: bool | None  # None: each plan without, selective and full, the fastest that fits

    def checkpointing_choices(self) -> tuple[bool | str, ...]:
        """The checkpointing settings to price each plan at, least recomputation first."""
        return (False, "selective", True) if self.checkpointing is None else (self.checkpointing,)


def _hf_refusal(shape: Shape, lo: Layout) -> str:
    """Why the strategies would refuse ``lo`` for a Hugging Face model ("" where they run it), from
    the plan the model declares (``costs.counting.hf_plan``: what ``parallel/hf/plan.py`` reads,
    the strategies' own source): tensor parallelism needs its tp_plan and a tp dividing the heads,
    key/value heads, MLP size and vocabulary; sequence parallelism needs the plan to name the norms
    between the splits (``parallel/tensor_parallel.check_sequence_parallel``; transformers' plans name
    none); a pipeline needs cut points (a declared or derived pipeline plan) and a decoder layer per stage."""
    if not shape.hf:
        return ""
    plan = hf_plan(shape)
    if lo.tp > 1:
        if not plan.tp_plan:
            return plan.tp_refusal or f"{shape.hf_arch} declares no tensor-parallel plan"
        bad = [f"{what} {size}" for what, size in plan.tp_divisible.items() if size % lo.tp]
        if bad:
            return f"tp={lo.tp} does not divide the {', '.join(bad)}"
        if lo.sequence_parallel and "sequence_parallel" not in plan.tp_plan.values():
            return "the model's tensor-parallel plan names no norms for sequence parallelism"
    if lo.pp > 1:
        if not plan.layers or plan.pp_refusal:
            return plan.pp_refusal or f"{shape.hf_arch} has no pipeline plan"
        if lo.pp * max(1, lo.virtual_stages) > shape.n_layer:
            return f"{lo.pp * lo.virtual_stages} pipeline stages for {shape.n_layer} decoder layers"
    return ""


def _lora_refusal(shape: Shape, lo: Layout) -> str:
    """Why the strategies would refuse ``lo`` for ``shape``'s LoRA ("" where they run it): QLoRA's NF4 base runs under
    single, ddp, zero1, zero2, zero3, fsdp, hsdp and pipelines, not under tensor parallelism nor host offload
    (``strategies/base.check_lora``)."""
    if shape.lora is None or shape.lora.base != "nf4":
        return ""
    if lo.cpu_offload or lo.tp > 1:
        return "QLoRA's NF4 base is not split by tensor parallelism nor offloaded to the host here"
    return ""


def _price(e: StrategyEntry, option: Option, micro: int, ask: _Ask, checkpointing: bool | str) -> Candidate | None:
    """One plan at one micro-batch size, with or without activation checkpointing, or None where it
    cannot run (a mesh or batch that does not divide, a layout the cost models do not price, a Hugging
    Face model's strategies would refuse)."""
    shape, cluster, n = ask.shape, ask.cluster, (1 if e.name == "single" else ask.cluster.devices)
    try:
        lo = layout(e.name, n, **option.layout)
    except ValueError:
        return None
    if _hf_refusal(shape, lo) or _lora_refusal(shape, lo):
        return None
    mesh = lo.mesh
    if lo.gather_bytes and (lo.tp > 1 or lo.pp > 1) and mesh.get("dp_shard", 1) <= 1:
        return None  # the mesh strategies apply FSDP mixed precision only over a dp_shard axis
    dp = mesh.get("dp_replicate", 1) * mesh.get("dp_shard", 1) * mesh.get("ep", 1)  # ep is a data axis too
    if ask.global_batch % (dp * micro):
        return None
    steps = ask.global_batch // (dp * micro)
    pipelined = lo.pp > 1
    if pipelined:
        if steps < lo.pp or (lo.schedule == "interleaved_1f1b" and steps % lo.pp):
            return None
        lo = replace(lo, n_microbatches=steps)
        batch_words = [f"strategy.n_microbatches={steps}"]
    else:
        batch_words = [f"trainer.accumulate_grad_batches={steps}"] if steps > 1 else []
    optimizer = option.optimizer or ask.optimizer
    try:
        mem = estimate(shape, devices=n, strategy=e.name, micro_batch_size=micro * (steps if pipelined else 1),
                       layout_=lo, precision=ask.precision, optimizer=optimizer, checkpointing=checkpointing,
                       device="cuda")
    except ValueError:  # a layout the estimator does not price (tensor parallelism of an MoE model)
        return None
    u = shape.units()
    cshape = comm_model.CommShape(shape=shape, micro_batch=micro)
    # gradients travel in the parameters' dtype (fp32 under autocast's bf16-mixed); gathers in
    # FSDP's param_dtype where the plan sets one
    param_bytes = int(bytes_per_param(ask.precision, optimizer)[1])
    gather_bytes = int(lo.gather_bytes or param_bytes)
    act_bytes = dtypes(ask.precision)[0]
    try:
        comm = comm_model.step_comm_bytes(
            e.name, n_params=u["total"], mesh=mesh, dtype_bytes=gather_bytes, shape=cshape,
            micro_batches=steps if pipelined else 1, schedule=lo.schedule, virtual_stages=lo.virtual_stages,
            expert_params=shape.expert_params(), data_parallel=lo.data_parallel,
            activation_bytes=act_bytes, recompute=checkpointing, sequence_parallel=lo.sequence_parallel,
            accumulate=1 if pipelined else steps,
            reduce_dtype_bytes=param_bytes if gather_bytes != param_bytes else None)
    except ValueError:
        comm = {}
    bandwidth = _axis_bandwidth(mesh, cluster)
    offloaded = u["total"] // max(1, lo.shard) if lo.cpu_offload else 0
    offloaded_trainable = shape.trainable() // max(1, lo.shard) if lo.cpu_offload else 0
    disk_gbs = cluster.nvme_gbs / min(n, cluster.devices_per_node) if lo.disk_offload else None
    time = step_time(shape, traffic=e.comm, mesh={k: v for k, v in mesh.items() if v > 1},
                     global_batch=ask.global_batch, comm=comm, bandwidth_gbs=bandwidth, device=cluster.device,
                     compute_bytes=act_bytes, recompute=checkpointing, schedule=lo.schedule, micro_batches=steps,
                     virtual_stages=lo.virtual_stages, offloaded_params=offloaded, accumulate=steps,
                     disk_gbs=disk_gbs, offloaded_trainable=offloaded_trainable)
    host = mem.offloaded * min(n, cluster.devices_per_node)
    disk = mem.on_disk * min(n, cluster.devices_per_node)
    fits = mem.peak <= ask.budget and (ask.host_budget is None or host <= ask.host_budget) and (
        not disk or (cluster.nvme_gb is not None and disk <= cluster.nvme_gb * GIB * NVME_HEADROOM))
    nodes = [f"trainer.devices={min(n, cluster.devices_per_node)}"] + (
        [f"trainer.num_nodes={cluster.nodes}"] if n > cluster.devices_per_node else [])
    ckpt = [f"strategy.activation_checkpointing={'selective' if checkpointing == 'selective' else 'true'}"] \
        if checkpointing else []
    return Candidate(e.name, nodes + [*option.overrides, *ckpt, *batch_words], mem, comm_model.total_bytes(comm),
                     comm_model.predicted_seconds(comm, {**mesh, "world": n}, bandwidth), fits, ask.global_batch,
                     time, micro, steps, host, e.preference, disk, checkpointing)


def _variants(e: StrategyEntry, option: Option, precision: str) -> list[Option]:
    """The plan as offered, and the variants a practitioner would try on it."""
    out = [option]
    lay = dict(option.layout)
    if lay.get("tp", 1) > 1:  # sequence parallelism: the activations between the splits sharded too
        out += [Option((*o.overrides, "strategy.sequence_parallel=true"), {**o.layout, "sequence_parallel": True},
                       o.optimizer) for o in list(out)]
    if lay.get("pp", 1) > 1:  # interleaved 1F1B: two stages per rank, half the bubble
        out += [Option((*o.overrides, "strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=2"),
                       {**o.layout, "schedule": "interleaved_1f1b", "virtual_stages": 2}, o.optimizer)
                for o in list(out)]
    sharding = e.sharding_for(lay.get("data_parallel") or e.defaults().get("data_parallel", "replicate"))
    if precision == "bf16-mixed" and sharding.grads == "fsdp" and e.name != "expert_parallel":
        out += [Option((*o.overrides, "strategy.param_dtype=bf16", "strategy.reduce_dtype=fp32"),
                       {**o.layout, "gather_bytes": 2}, o.optimizer) for o in list(out)]
    return out


def _best(cands: list[Candidate]) -> Candidate:
    """The fastest; within ``TIE`` of it, the catalogue's preference, then the fewest options (plain AdamW
    before 8-bit states, fp32 gathers before bf16 ones), then the smaller peak."""
    fastest = min(c.seconds for c in cands)
    near = [c for c in cands if c.seconds <= fastest * (1 + TIE)]
    return min(near, key=lambda c: (c.preference, len(c.overrides), c.memory.peak, c.seconds))


def advise(shape: Shape, cluster: Cluster, *, precision: str = "bf16-mixed", optimizer: str = "adamw",
           micro_batch_size: int = 1, checkpointing: bool | None = None, headroom: float = 0.9,
           preset: str | None = None, global_batch: int | None = None, pretrained: str | None = None,
           finetune: bool = False, lora_rank: int = LORA_RANK) -> Advice:
    """The fastest plan that fits. ``checkpointing``: None prices every plan with no, selective and full
    activation checkpointing and keeps the fastest that fits (a plan that fits without it is not
    checkpointed); True (full) or False fixes it. ``global_batch``: sequences per optimizer step (None: one
    ``micro_batch_size`` per device, what data parallelism alone would train). ``preset`` /
    ``pretrained``: how the command names the model (``model=<preset>``; ``model.pretrained=<dir>``,
    the directory ``shape`` was read from), else by its sizes. ``finetune``: the run fine-tunes ``shape``:
    full fine-tuning, LoRA and QLoRA at ``lora_rank`` are each planned and one is chosen (``advise_finetune``)."""
    if finetune:
        return advise_finetune(shape, cluster, precision=precision, optimizer=optimizer,
                               micro_batch_size=micro_batch_size, checkpointing=checkpointing, headroom=headroom,
                               preset=preset, global_batch=global_batch, pretrained=pretrained, lora_rank=lora_rank)
    budget = cluster.device_memory_gb * GIB * headroom
    host_budget = cluster.host_memory_gb * GIB * headroom if cluster.host_memory_gb is not None else None
    g = global_batch or micro_batch_size * cluster.devices
    ask = _Ask(shape, cluster, budget, host_budget, g, precision, optimizer, checkpointing)
    gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    fleet = Fleet(cluster.devices, cluster.devices_per_node, cluster.nodes,
                  shape.n_experts if shape.n_moe_layers else 0, optimizer)
    cands = _priced_plans(fleet, ask, micro_batch_size)
    reasons: list[str] = []
    # the whole step on one device: the least checkpointing that fits, else the smallest peak
    wholes = []
    for how in ask.checkpointing_choices():
        try:
            wholes.append((estimate(shape, devices=1, strategy="single", micro_batch_size=micro_batch_size,
                                    precision=precision, optimizer=optimizer, checkpointing=how, device="cuda"), how))
        except ValueError:  # a checkpointing the estimator does not price for this model
            continue
    whole, how = next((w for w in wholes if w[0].peak <= budget), min(wholes, key=lambda w: w[0].peak))
    named = {True: " with full activation checkpointing", "selective": " with selective activation checkpointing"}
    if whole.peak <= budget:
        reasons.append(f"the whole step{named.get(how, '')} ({gib(whole.peak)} at its peak) fits one device "
                       f"({gib(budget)} usable)")
    else:
        reasons.append(f"the whole step{named.get(how, '')} needs {gib(whole.peak)} at its peak ({whole.moment}): "
                       f"more than one device ({gib(budget)} usable)")
    fitting = [c for c in cands if c.fits]
    if not fitting and cluster.nvme_gb is not None:  # the disk tier: the same training, states in files
        disk = _disk_offload(fleet, ask, micro_batch_size)
        cands += disk
        fitting = [c for c in disk if c.fits]
        if fitting:
            c = min(fitting, key=lambda c: c.disk_bytes)
            reasons.append(f"CPU offload's states do not fit the host memory stated ({cluster.host_memory_gb:g} GiB per "
                           f"node); in files on the nodes' NVMe (zero3_offload strategy.offload_dir) they take "
                           f"{c.disk_bytes / GIB:.1f} GiB of its {cluster.nvme_gb:g} GiB, and the host holds "
                           f"{c.host_bytes / GIB:.1f} GiB of them at a time (the optimizer step's chunks); point "
                           f"strategy.offload_dir at the NVMe")
    if not fitting and optimizer in ("adamw", "adam"):  # 8-bit AdamW states (torchao) before tiling
        eight = _priced_plans(fleet, ask, micro_batch_size, eight_bit=True)
        cands += eight
        fitting = [c for c in eight if c.fits]
        if fitting:
            reasons.append("with AdamW's states in 8 bits (torchao AdamW8bit: 2 bytes per parameter instead of 8) "
                           f"{len(fitting)} plan{'s' if len(fitting) > 1 else ''} fit")
    if not fitting and shape.lora is None:  # (parallel/memory/tiling.py tiles plain linears, not LoRA's)
        tiled = _tiled_offload(ask, micro_batch_size, reasons)
        if tiled is not None:
            cands.append(tiled)
            fitting = [tiled]
    if not fitting:
        host = [c for c in cands if c.memory.peak <= budget and not c.fits]
        reasons.append("no candidate's predicted peak fits: add devices, lower the micro-batch or the sequence"
                       + (f" (offload fits the devices but needs {gib(min(c.host_bytes for c in host))} of host "
                          f"memory per node, more than the {cluster.host_memory_gb:g} GiB stated)" if host else ""))
        return Advice(None, [], reasons, 0, cands, model_overrides(shape, preset, g, pretrained), precision,
                      shape=shape, cluster=cluster, budget=budget, host_budget=host_budget)
    best = _best(fitting)
    reasons += _why(best, fitting, cluster, ask.checkpointing is None, shape)
    return Advice(best.strategy, best.overrides, reasons, best.memory.peak, cands,
                  model_overrides(shape, preset, best.global_batch, pretrained), precision, best, shape, cluster,
                  budget, host_budget)


def advise_finetune(shape: Shape, cluster: Cluster, *, lora_rank: int = LORA_RANK, **kwargs: Any) -> Advice:
    """``--finetune``: the fastest plan of full fine-tuning, of LoRA (rank ``lora_rank``, alpha twice it, the default
    targets: attention and MLP projections) and of QLoRA (the same with its base in NF4), each by ``advise``; then
    the method that trains the most among those whose plan fits at a reasonable speed: full fine-tuning when it
    fits with a step at most ``REASONABLE`` times LoRA's and QLoRA's fastest, else LoRA by the same rule against
    QLoRA, else QLoRA. The answer is the chosen method's advice (its command sets ``model.lora``), with every
    method's in ``methods`` and the reasons for the choice first."""
    from lightning_par.parallel.adapters.lora import LoRAConfig

    lora = LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank)
    methods: list[tuple[str, Advice]] = []
    for cfg in (None, lora, replace(lora, base="nf4")):
        priced = shape.with_lora(cfg)
        methods.append((method_name(priced), advise(priced, cluster, **kwargs)))
    chosen, why = None, []
    for i, (name, a) in enumerate(methods):
        if a.chosen is None:
            why.append(f"{name}: no plan fits")
            continue
        lighter = [b.chosen for _, b in methods[i + 1:] if b.chosen is not None]
        fastest = min(lighter, key=lambda c: c.seconds) if lighter else None
        if fastest is None or a.chosen.seconds <= REASONABLE * fastest.seconds:
            chosen = a
            why.append(f"{name} fits ({a.chosen.label}, {a.chosen.memory.peak / GIB:.1f} GiB per device, "
                       f"{a.chosen.seconds:.3f} s per step"
                       + (f": within {REASONABLE:g}x of the {fastest.seconds:.3f} s of a method that trains less"
                          if fastest is not None else "") + "), so it is chosen")
            break
        why.append(f"{name} fits only at {a.chosen.seconds:.3f} s per step ({a.chosen.label}), more than "
                   f"{REASONABLE:g}x the {fastest.seconds:.3f} s of a method that trains less")
    if chosen is None:  # nothing fits: full fine-tuning's answer says why
        chosen = methods[0][1]
    chosen.methods = methods
    chosen.reasons = [f"fine-tuning ({', '.join(n for n, _ in methods)} weighed): {'; '.join(why)}"] + chosen.reasons
    return chosen


def _priced_plans(fleet: Fleet, ask: _Ask, micro: int, eight_bit: bool = False) -> list[Candidate]:
    """Every catalogue entry's plans and their variants, one row per variant at its fastest fitting
    micro-batch size (else its smallest peak); ``eight_bit``: each with 8-bit AdamW states instead
    (the one-device entry offers those itself)."""
    out: list[Candidate] = []
    for e in sorted((e for e in CATALOG if e.advise), key=lambda e: e.preference):
        for option in e.advise(fleet):
            if eight_bit:
                if option.optimizer is not None or e.name == "single":
                    continue
                option = Option((*option.overrides, "model.optimizer=adamw8bit"), option.layout, "adamw8bit")
            priced = [c for o in _variants(e, option, ask.precision) for k in MICRO_STEPS
                      for c in _checkpointing_variants(e, o, micro * k, ask)]
            by_label: dict[str, list[Candidate]] = {}
            for c in priced:
                by_label.setdefault(c.label, []).append(c)
            out += [_pick(group) for group in by_label.values()]
    return out


def _checkpointing_variants(e: StrategyEntry, option: Option, micro: int, ask: _Ask) -> list[Candidate]:
    """The plan at each checkpointing setting, least recomputation first, up to the first that fits: a
    later one is never faster (the step model charges full checkpointing a recomputed forward, selective
    no FLOPs, and both a recomputed all-to-all), so it is priced only while the earlier ones do not fit."""
    out = []
    for how in ask.checkpointing_choices():
        c = _price(e, option, micro, ask, how)
        if c is not None:
            out.append(c)
            if c.fits:
                break
    return out


def _pick(group: list[Candidate]) -> Candidate:
    """One plan's row: its fastest fitting micro-batch size and checkpointing, else its smallest peak. A
    checkpointed row records the smallest peak the plan reached without checkpointing (why it needs it)."""
    fitting = [c for c in group if c.fits]
    chosen = _best(fitting) if fitting else min(group, key=lambda c: c.memory.peak)
    plain = [c.memory.peak for c in group if not c.checkpointing]
    if chosen.checkpointing and plain and not any(c.fits for c in group if not c.checkpointing):
        chosen.peak_without_checkpointing = min(plain)
    return chosen


def _why(best: Candidate, fitting: list[Candidate], cluster: Cluster, weighed_checkpointing: bool,
         shape: Shape) -> list[str]:
    from lightning_par.costs.step_time import flops_per_token, forward_flops_per_token

    t = best.time
    assert t is not None
    # the forward's share of a step's FLOPs: a third; more with LoRA's frozen base (no weight gradients)
    fwd = forward_flops_per_token(shape) / flops_per_token(shape)
    n = len(fitting)
    out = [f"of the {n} plan{'s' if n > 1 else ''} that fit{'' if n > 1 else 's'}, {best.label} predicts the "
           f"shortest step: {t.total:.3f} s "
           f"(compute {t.compute:.3f} s, exposed communication and offload copies {t.comm_exposed:.3f} s, bubble "
           f"{t.bubble:.3f} s" + (f", {'paged (disk tier)' if best.disk_bytes else 'host'} optimizer step {t.offload:.3f} s"
                                   if t.offload else "") + f"), MFU {100 * t.mfu:.0f}%"]
    others = sorted((c for c in fitting if c.strategy != best.strategy), key=lambda c: c.seconds)
    if others:
        o = others[0]
        out.append(f"next: {o.label} at {o.seconds:.3f} s per step")
    moe = best.memory.mesh.get("ep", 1) > 1 or best.strategy == "expert_parallel"
    if moe:
        out.append(f"{best.label} spreads the experts over ranks and moves tokens to them (all-to-all) instead of "
                   f"replicating or gathering expert weights; it communicates {best.comm_bytes / 1e9:.2f} GB per step")
    elif any(c.strategy == "expert_parallel" for c in fitting):
        out.append(f"{best.label} replicates or shards the experts like every other weight: its gradient "
                   "reduction overlaps backward, while expert parallelism's all-to-all of the tokens sits on the "
                   "critical path of every MoE layer")
    if "model.optimizer=adamw8bit" in best.overrides and best.strategy == "single":
        out.append(f"with 8-bit AdamW states (torchao AdamW8bit) the step fits one device "
                   f"({best.memory.peak / GIB:.1f} GiB at its peak): no sharding or offload needed")
    if best.disk_bytes:
        out.append(f"{best.label} keeps its states in files at strategy.offload_dir: {best.disk_bytes / GIB:.1f} GiB "
                   f"per node on the NVMe ({cluster.nvme_gb:g} GiB stated), {best.host_bytes / GIB:.1f} GiB of them "
                   "in host memory at a time")
    elif best.host_bytes:
        stated = (f"within the {cluster.host_memory_gb:g} GiB stated" if cluster.host_memory_gb is not None
                  else "host memory was not stated (--host-memory): check the nodes have it")
        out.append(f"{best.label} keeps its states in host memory: {best.host_bytes / GIB:.1f} GiB per node, {stated}")
    if best.peak_without_checkpointing is not None:
        cost = ("selective: matmul outputs kept, no matmul recomputed" if best.checkpointing == "selective" else
                f"recomputing the forward adds {t.compute * fwd / (1 + fwd):.3f} s of compute per step "
                f"({'a third' if abs(fwd - 1 / 3) < 1e-9 else f'{fwd:.0%}'} of the plain step's)")
        out.append(f"activation checkpointing: without it the peak would be {best.peak_without_checkpointing / GIB:.1f} "
                   f"GiB, over the usable memory; {cost}")
    elif not best.checkpointing and weighed_checkpointing:
        out.append(f"no activation checkpointing: the plan fits without it, and recomputing the forward would add "
                   f"about {t.compute * fwd:.3f} s of compute per step")
    if best.time.bubble:
        out.append(f"pipeline bubble: {100 * t.bubble / t.total:.0f}% of the step ({best.steps} micro-batches)")
    return out


def _disk_offload(fleet: Fleet, ask: _Ask, micro: int) -> list[Candidate]:
    """ZeRO-3 offload's plans with the disk tier: the offloaded states in files at ``NVME_DIR``
    (``parallel/sharding/disk_offload.py``), host memory holding the optimizer step's chunks."""
    e = next(e for e in CATALOG if e.name == "zero3_offload")
    out = []
    for option in e.advise(fleet):
        disk = Option((*option.overrides, f"strategy.offload_dir={NVME_DIR}"), {**option.layout, "disk_offload": True},
                      option.optimizer)
        priced = [c for k in MICRO_STEPS for c in _checkpointing_variants(e, disk, micro * k, ask)]
        if priced:
            out.append(_pick(priced))
    return out


def tiling_plan(shape: Shape, tiles: int) -> dict[str, int] | None:
    """``strategy.tiling`` for every block's matmuls, the output head and the vocabulary embedding in
    ``tiles`` tiles, by the model's own paths (``costs.counting.module_paths``: ``net.blocks.<i>``
    in our GPT, ``net.model.layers.<i>`` in a Hugging Face Llama); None where ``tiles`` does not divide
    a layer's output features. A Hugging Face model's head and embedding are named only where
    ``parallel/memory/tiling.py`` itself would tile them (``_vocab_tileable``: a tied pair only where it tiles
    both uses of the shared table together)."""
    out_features = block_linears(shape)
    if any(f % tiles for f in out_features.values()) or shape.vocab_size % tiles:
        return None
    paths = module_paths(shape)
    tiling = {f"{paths['blocks']}.{i}.{name}": tiles for i in range(shape.n_layer) for name in out_features}
    if _vocab_tileable(shape, tiles):
        tiling.update({paths["head"]: tiles, paths["embed"]: tiles})
    return tiling


def _vocab_tileable(shape: Shape, tiles: int) -> bool:
    """Whether ``parallel/memory/tiling.py``'s own check (``tileable``) accepts the head and the embedding of
    the model (our GPT's: always, they are plain and untied); asked of the Hugging Face model itself."""
    if not shape.hf:
        return True
    from lightning_par import ConfigError
    from lightning_par.parallel.memory.tiling import tileable

    net, paths = hf_model(shape), module_paths(shape)
    try:
        for part in ("head", "embed"):
            tileable(net, paths[part].removeprefix("net."), tiles)
    except ConfigError:
        return False
    return True


def _tiled_offload(ask: _Ask, micro: int, reasons: list[str]) -> Candidate | None:
    """ZeRO-3 + CPU offload with every large layer tiled -- each block's linears (attention and MLP),
    the output head and the vocabulary embedding (``tiling_plan``) -- the fewest tiles that fit
    (ZeRO-Infinity)."""
    shape = ask.shape
    e = next(e for e in CATALOG if e.name == "zero3_offload")
    for k in TILES:
        tiling = tiling_plan(shape, k)
        if tiling is None:
            continue
        text = "{" + ",".join(f"{p}:{t}" for p, t in tiling.items()) + "}"
        for option in _variants(e, Option((f"+strategy.tiling={text}",), {"tiling": tiling}), ask.precision):
            # selective checkpointing does not run a block whose layers are tiled (strategies/base.py refuses it)
            cand = next((c for ckpt in ask.checkpointing_choices() if ckpt != "selective"
                         if (c := _price(e, option, micro, ask, ckpt)) is not None and c.fits), None)
            if cand is not None:
                what = ("linears, the output head and the embedding" if any(
                    p.endswith(module_paths(shape)["head"]) for p in tiling) else "linears")
                reasons.append(f"even ZeRO-3 with offload must all-gather a whole layer; tiling every block's "
                               f"{what} into {k} tiles (each its own FSDP unit) "
                               f"brings the peak to {cand.memory.peak / GIB:.1f} GiB")
                return cand
    return None
