"""The cost model's one shape of a decoder: ``Shape``, the sizes every cost formula reads.

One ``Shape`` describes our GPT / MoE (``models/gpt.py``, ``models/moe.py``) or, with ``hf_arch``, a
Hugging Face decoder as ``models/hf/causal_lm.py`` builds it, and the sequence length it trains on. The memory
formulas (``activations.py``, ``peak.py``), the step time (``step_time.py``) and the comm model
(``comm.py``: a ``CommShape`` is a ``Shape`` at one micro-batch) all read this one class.

Where a shape comes from:

- a model declares it: ``cost_shape(seq_len)`` on ``GPTModule`` / ``MoEModule`` / ``HFCausalLM`` names its
  family and config (the models sit below ``costs/`` in the package's layers, so they name what to read
  rather than build the class), and ``Shape.of_model`` reads it. A model without ``cost_shape`` has no
  shape: the comm prediction is null with its note, ``mode=estimate`` traces it;
- a config: ``Shape.of_gpt`` (a ``GPTConfig`` / ``MoEConfig``), ``Shape.of_hf`` (a transformers config of a
  family in ``HF_ARCHS``), ``Shape.of`` (either);
- its fields, by name.

Parameter counts (``Shape.units`` and the tensor-parallel groups) are counted from the model built on the
meta device, in ``counting.py``.
"""

from __future__ import annotations

import dataclasses

import json
from dataclasses import dataclass
from typing import Any

from lightning_par.costs import counting

#: transformers architectures whose layers ``activations.hf_layer_bytes_per_token`` describes (measured op by op);
#: others (Gemma's extra norms and soft-capping, MoE families) are traced instead (``costs/traced.py``)
HF_ARCHS = ("llama", "qwen2", "gpt2")
#: tensors of the MLP's inner width an activation function saves for its backward, besides its output
#: (which the next op saves): torch's fused GELU / SiLU their input; transformers' ``gelu_new`` is
#: written out in Python ops (0.5 x (1 + tanh(c (x + 0.044715 x^3)))) and keeps four (what
#: ``activations.py``'s formulas count; here because ``Shape.of_hf`` refuses any other activation)
ACT_SAVED = {"gelu": 1, "gelu_pytorch_tanh": 1, "silu": 1, "gelu_new": 4}
#: transformers config fields a ``Shape`` holds in its own fields (``models/hf/causal_lm.py``'s size vocabulary:
#: ``hf_config``'s arguments), by architecture family
_HF_SIZE_FIELDS = {
    "gpt2": ("n_embd", "n_layer", "n_head", "n_inner", "n_positions", "vocab_size", "tie_word_embeddings",
             "activation_function"),
    "": ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "intermediate_size", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "hidden_act"),
}
#: fields that do not change the model trained here: token ids (the data's own; ``hf_config`` sets
#: none), the KV cache, dropout (off in every run), the per-layer attention kinds (derived from the
#: depth; ``of_hf`` refuses any but full attention)
_HF_IGNORED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "layer_types", "resid_pdrop",
                      "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout", "summary_first_dropout",
                      "dropout", "activation_dropout")


def _hf_attention(config: Any) -> str:
    """The attention backend of a transformers config in ``models/attention.py``'s names (its
    ``_attn_implementation``; ``sdpa_fa`` is sdpa_flash there). Another implementation (flash_attention_2,
    flex_attention: kernels that keep no s x s scores either) or none is priced as ``sdpa``."""
    from lightning_par.models.attention import NAMES, name_of_hf_key

    name = name_of_hf_key(getattr(config, "_attn_implementation", None))
    return name if name in NAMES else "sdpa"


def hf_extra_fields(config: Any) -> tuple[tuple[str, str], ...]:
    """The fields of a transformers config that a ``Shape``'s sizes do not say and that differ from
    the architecture's defaults (``attention_bias``, ``mlp_bias``, ``rope_parameters``,
    ``rms_norm_eps``, ...), as (name, JSON value) pairs, sorted: the config's class fields only
    (not ``PretrainedConfig``'s bookkeeping: architectures, dtype, ...)."""
    from transformers import PretrainedConfig

    base = set(PretrainedConfig().to_dict())
    default = type(config)().to_dict()
    mine = config.to_dict()
    skip = set(_HF_SIZE_FIELDS["gpt2" if config.model_type == "gpt2" else ""]) | set(_HF_IGNORED_FIELDS) | base
    return tuple(sorted((k, json.dumps(v, sort_keys=True, default=str)) for k, v in mine.items()
                        if k in default and k not in skip and not k.startswith("_") and v != default[k]))


@dataclass(frozen=True)
class Shape:
    """A decoder's shape and the sequence length it trains on: our GPT / MoE (fields as in
    ``GPTConfig``) or, with ``hf_arch``, a Hugging Face decoder as ``models/hf/causal_lm.py`` builds it. For
    those ``mlp_ratio`` and ``dropout`` are not used (``mlp_hidden`` says the MLP's size; dropout is
    off) and ``bias`` says whether the norms have one (linear biases, e.g. Qwen2's q/k/v, are in the
    parameter counts, which come from the model)."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq_len: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    block_size: int | None = None  # the position table's size (None: seq_len)
    # mixture of experts (models/moe.py's MoEConfig; n_experts == 0: a dense GPT)
    n_experts: int = 0
    top_k: int = 0
    moe_every: int = 1
    expert_hidden: int = 0  # one expert's inner size (0: mlp_ratio * n_embd)
    shared_expert: bool = False
    # what Hugging Face decoders add (defaults: our GPT's layout)
    kv_heads: int = 0  # key/value heads of grouped-query attention (0: n_head)
    mlp_hidden: int = 0  # the MLP's inner size (0: mlp_ratio * n_embd)
    gated_mlp: bool = False  # down(act(gate(x)) * up(x)) (Llama's SwiGLU) instead of proj(act(fc(x)))
    hidden_act: str = "gelu"  # the MLP's activation, by transformers' name (``ACT_SAVED``)
    fused_qkv: bool = False  # one linear computes q, k and v (GPT-2's c_attn)
    rms_norm: bool = False  # RMSNorm (a weight, fp32 statistics) instead of LayerNorm
    tied: bool = False  # the output head reuses the token embedding's table
    learned_positions: bool = True  # a position table of block_size rows (False: rotary, no table)
    hf_arch: str = ""  # the transformers model_type (``HF_ARCHS``); "": models/gpt.py / moe.py
    #: further transformers config fields, (name, JSON value), that differ from the architecture's
    #: defaults (``hf_extra_fields``: attention / MLP biases, rotary parameters, norm epsilon, ...)
    hf_extra: tuple[tuple[str, str], ...] = ()
    #: tokens per chunk of the chunked linear cross-entropy (``model.chunked_loss``); 0: the logits whole
    loss_chunk: int = 0
    #: the attention backend (``models/attention.py``'s names): ``eager`` and ``sdpa_math`` keep the s x s
    #: softmax output per head (``activations.attention_kernel``); sdpa lets torch pick the kernel
    attn_implementation: str = "sdpa"
    #: low-rank adapters on a frozen model (``model.lora``: a ``parallel/adapters/lora.LoRAConfig``; None: full
    #: fine-tuning). What trains, what is frozen and what is stored in NF4 is counted from the model built on the
    #: meta device with the adapters applied (``counting.lora_units``)
    lora: Any = None

    @property
    def hf(self) -> bool:
        """A Hugging Face decoder (``models/hf/causal_lm.py``), not our GPT / MoE."""
        return bool(self.hf_arch)

    @property
    def hf_fields(self) -> dict[str, Any]:
        """``hf_extra`` as config fields (the values decoded)."""
        return {k: json.loads(v) for k, v in self.hf_extra}

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.n_head

    @property
    def kv_width(self) -> int:
        """Features of k (and of v): key/value heads x head_dim."""
        return self.n_kv_heads * (self.n_embd // self.n_head)

    @property
    def inner(self) -> int:
        """The dense MLP's inner size."""
        return self.mlp_hidden or self.mlp_ratio * self.n_embd

    @property
    def colwise_inputs(self) -> int:
        """Column-parallel linears of a layer that read a norm's output: q, k, v (GPT-2: its fused
        c_attn) and fc (gated: gate and up). Each keeps its own autocast copy of that input, and under
        tensor parallelism each all-reduces its input gradient in backward."""
        return (1 if self.fused_qkv else 3) + (2 if self.gated_mlp else 1)

    @property
    def n_moe_layers(self) -> int:
        """Blocks whose MLP is a routed MoE layer (block i when (i + 1) % moe_every == 0)."""
        return self.n_layer // self.moe_every if self.n_experts else 0

    @property
    def moe_hidden(self) -> int:
        return self.expert_hidden or self.mlp_ratio * self.n_embd

    @classmethod
    def of(cls, config: Any, seq_len: int | None = None) -> Shape:
        """From a ``GPTConfig`` / ``MoEConfig`` (``of_gpt``) or a transformers config (``of_hf``);
        ``seq_len`` defaults to the longest sequence the model takes."""
        from lightning_par.models.gpt import GPTConfig

        return cls.of_gpt(config, seq_len) if isinstance(config, GPTConfig) else cls.of_hf(config, seq_len)

    @classmethod
    def of_gpt(cls, config: Any, seq_len: int | None = None) -> Shape:
        """From a ``GPTConfig`` (``models/gpt.py``) or an ``MoEConfig`` (``models/moe.py``: its experts too);
        ``seq_len`` defaults to ``block_size``."""
        from lightning_par.models.moe import MoEConfig

        moe = dict(n_experts=int(config.n_experts), top_k=int(config.top_k), moe_every=int(config.moe_every),
                   expert_hidden=int(config.expert_hidden or 0), shared_expert=bool(config.shared_expert)) \
            if isinstance(config, MoEConfig) and config.n_experts else {}
        return cls(config.n_layer, config.n_embd, config.n_head, config.vocab_size, int(seq_len or config.block_size),
                   config.mlp_ratio, float(config.dropout), config.bias, config.block_size, **moe,
                   attn_implementation=str(getattr(config, "attn_implementation", "sdpa")))

    @classmethod
    def of_model(cls, module: Any, seq_len: int | None = None) -> Shape | None:
        """The shape a model declares (``cost_shape(seq_len)``: ``{"family": "gpt" | "hf", "config": ...,
        "seq_len": ...}``, read by ``of_gpt`` / ``of_hf``), at ``seq_len`` (None: the longest sequence the
        model takes), with the model's LoRA (``module.lora``: ``with_lora``); None for a model that declares none,
        and for LoRA on an MoE model (not priced op by op). ValueError for a declared family the cost model does not
        price (``of_hf``: ``HF_ARCHS``)."""
        declare = getattr(module, "cost_shape", None)
        if declare is None:
            return None
        declared = declare(seq_len)
        read = {"gpt": cls.of_gpt, "hf": cls.of_hf}.get(declared["family"])
        if read is None:
            raise ValueError(f"{type(module).__name__}.cost_shape: unknown family {declared['family']!r} "
                             f"(choose from: gpt, hf)")
        shape = read(declared["config"], declared.get("seq_len"))
        shape = dataclasses.replace(shape, loss_chunk=int(declared.get("loss_chunk") or 0),
                                    attn_implementation=str(declared.get("attn_implementation")
                                                            or shape.attn_implementation))
        # LoRA is read here, the one place: every model of ``models/module.py`` carries ``lora`` (None: off)
        lora = getattr(module, "lora", None)
        if lora is not None and shape.n_experts:
            return None  # LoRA on an MoE model is not priced op by op: no shape (mode=estimate traces it)
        return shape.with_lora(lora)

    def with_lora(self, lora: Any) -> Shape:
        """This shape with ``lora`` (a ``LoRAConfig``, a ``model.lora`` mapping, or None: full fine-tuning).
        ValueError where the cost model does not price it (``counting.lora_units``: an MoE model; targets that
        match no linear)."""
        if lora is not None and not hasattr(lora, "matches"):
            from lightning_par.parallel.adapters.lora import lora_option

            lora = lora_option(lora)
        shape = dataclasses.replace(self, lora=lora or None)
        if shape.lora is not None:
            counting.lora_units(shape)  # refuses here, in one line, what it cannot count
        return shape

    @classmethod
    def of_hf(cls, config: Any, seq_len: int | None = None) -> Shape:
        """From the transformers config ``models/hf/causal_lm.py`` builds (``HFCausalLM.hf_config``: no dropout,
        head_dim = hidden / heads); ``seq_len`` defaults to its longest sequence. ValueError for an
        architecture whose layers this module does not describe (``HF_ARCHS``)."""
        arch = str(config.model_type)
        if arch not in HF_ARCHS:
            raise ValueError(f"the estimator has no op-by-op shape for a {arch!r} model (only "
                             f"{', '.join(HF_ARCHS)}); mode=estimate traces any model (costs/traced.py)")
        gpt2 = arch == "gpt2"
        hidden = int(config.n_embd if gpt2 else config.hidden_size)
        heads = int(config.n_head if gpt2 else config.num_attention_heads)
        if not gpt2 and int(getattr(config, "head_dim", None) or hidden // heads) * heads != hidden:
            raise ValueError(f"{arch}: head_dim x heads != hidden ({config.head_dim} x {heads} != {hidden}); the "
                             "estimator assumes models/hf/causal_lm.py's head_dim = hidden / heads")
        act = str(config.activation_function if gpt2 else config.hidden_act)
        if act not in ACT_SAVED:
            raise ValueError(f"{arch}: the estimator does not know what activation {act!r} saves "
                             f"(known: {', '.join(ACT_SAVED)})")
        positions = int(config.n_positions if gpt2 else config.max_position_embeddings)
        inner = int((config.n_inner if gpt2 else config.intermediate_size) or 4 * hidden)
        kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention"}
        if kinds:
            raise ValueError(f"{arch}: layers of {', '.join(sorted(kinds))} (sliding-window attention): the estimator "
                             "models full causal attention only")
        return cls(int(config.n_layer if gpt2 else config.num_hidden_layers), hidden, heads, int(config.vocab_size),
                   int(seq_len or positions), bias=gpt2, block_size=positions,
                   kv_heads=0 if gpt2 else int(config.num_key_value_heads or heads), mlp_hidden=inner,
                   gated_mlp=not gpt2, hidden_act=act, fused_qkv=gpt2, rms_norm=not gpt2,
                   tied=bool(config.tie_word_embeddings), learned_positions=gpt2, hf_arch=arch,
                   hf_extra=hf_extra_fields(config), attn_implementation=_hf_attention(config))

    def hf_config(self, layers: int | None = None) -> Any:
        """The transformers config of a Hugging Face shape, built by ``models/hf/causal_lm.py``'s ``hf_config``
        with its further fields (``hf_extra``; ``layers``: another depth, e.g. one layer to count a
        layer's parameters)."""
        if not self.hf:
            raise ValueError("hf_config: not a Hugging Face shape (hf_arch is empty); see gpt_config")
        from lightning_par.models.hf.causal_lm import hf_config

        act = {"activation_function" if self.hf_arch == "gpt2" else "hidden_act": self.hidden_act}
        return hf_config(self.hf_arch, hidden=self.n_embd, layers=layers or self.n_layer, heads=self.n_head,
                         kv_heads=self.kv_heads or None, intermediate=self.inner, vocab=self.vocab_size,
                         max_positions=self.block_size or self.seq_len, tie_word_embeddings=self.tied,
                         attn_implementation=self.attn_implementation, **act, **self.hf_fields)

    def gpt_config(self, dense: bool = False):
        """The model's config: a ``GPTConfig``, or a ``MoEConfig`` for an MoE shape (``dense``: the
        GPT of the same dimensions, whose blocks are the MoE model's dense blocks)."""
        if self.hf:
            raise ValueError(f"gpt_config: a Hugging Face {self.hf_arch} shape builds no GPT; see hf_config")
        from lightning_par.models.gpt import GPTConfig

        fields = dict(vocab_size=self.vocab_size, block_size=self.block_size or self.seq_len, n_layer=self.n_layer,
                      n_head=self.n_head, n_embd=self.n_embd, mlp_ratio=self.mlp_ratio, dropout=self.dropout,
                      bias=self.bias, attn_implementation=self.attn_implementation)
        if not self.n_experts or dense:
            return GPTConfig(**fields)
        from lightning_par.models.moe import MoEConfig

        return MoEConfig(**fields, n_experts=self.n_experts, top_k=self.top_k, moe_every=self.moe_every,
                         expert_hidden=self.expert_hidden or None, shared_expert=self.shared_expert)

    def units(self) -> dict[str, int]:
        """Parameters of the model's parts, counted from the model built on the meta device:
        ``embed``, ``block`` (one), ``head``, ``lm_head``, ``block_matmul`` (weights a block
        multiplies by), the largest ``nn.Linear`` of a block (``block_linear``) and ``total``.
        MoE shapes add ``moe_block`` (one MoE block, experts included), ``moe_experts`` (its routed
        experts, what expert parallelism divides by ep) and ``moe_matmul`` (its router and shared
        expert); ``block`` stays a dense block. Hugging Face shapes add ``tied``: the elements the
        head shares with the embedding (0 untied), in both ``embed`` and ``head`` (a pipeline's
        first and last stages each hold a copy) and once in ``total`` (``counting.units``)."""
        return counting.units(self)

    def expert_params(self) -> int:
        """Parameters of the routed experts of every MoE layer (what expert parallelism divides by
        ep); 0 for a dense model."""
        return self.n_moe_layers * self.units()["moe_experts"] if self.n_moe_layers else 0

    def tp_params(self, tp: int) -> int:
        """Parameters one tensor-parallel rank holds (``counting.tp_params``)."""
        return counting.tp_params(self, tp)

    def root_params(self, tp: int = 1) -> int:
        """Parameters FSDP leaves to the root (``counting.root_params``)."""
        return counting.root_params(self, tp)

    def param_tensors(self) -> int:
        """Parameter tensors of the dense model (``counting.param_tensors``)."""
        return counting.param_tensors(self)

    def lora_units(self) -> dict[str, Any]:
        """What LoRA trains and freezes (``counting.lora_units``); {} without LoRA."""
        return counting.lora_units(self) if self.lora is not None else {}

    def trainable(self) -> int:
        """Parameters that train (get gradients and optimizer states): every one without LoRA."""
        return self.lora_units()["trainable"] if self.lora is not None else self.units()["total"]

    def tp_trainable(self, tp: int = 1) -> int:
        """Parameters one tensor-parallel rank trains (``counting.tp_trainable``)."""
        return counting.tp_trainable(self, tp)

    def trainable_tensors(self) -> int:
        """Parameter tensors that train (ZeRO-2's per-tensor flags): every one without LoRA."""
        return self.lora_units()["trainable_tensors"] if self.lora is not None else self.param_tensors()

    def nf4_weights(self, dtype_bytes: int, tp: int = 1, *, gathered: bool = False) -> tuple[int, int]:
        """(elements, bytes) of the weights stored in NF4 on one tensor-parallel rank: with ``lora.base=nf4``
        the adapted linears' base weights, every layer's (``states.nf4_bytes``, scales in ``dtype_bytes``;
        ``gathered``: the bytes FSDP all-gathers of them); (0, 0) otherwise."""
        if self.lora is None or self.lora.base != "nf4":
            return 0, 0
        from lightning_par.costs.states import nf4_bytes

        numels = self.lora_units()["block_adapted_numels"]
        return (self.n_layer * sum(n // tp for n in numels),
                self.n_layer * sum(nf4_bytes(n // tp, dtype_bytes, gathered=gathered) for n in numels))

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: a LayerNorm's weight (and bias when the model has biases); an
        RMSNorm's weight."""
        return self.n_embd if self.rms_norm else self.n_embd * (2 if self.bias else 1)
