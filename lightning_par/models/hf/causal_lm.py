"""A Hugging Face ``transformers`` causal language model, built from a config (never downloaded).

``HFCausalLM`` is a ``ParModule`` (same optimizer options and loss) around
``AutoModelForCausalLM.from_config``: GPT-2, Llama, Qwen2, Mistral, Gemma-2 or Gemma-3 (text) at any
size, with SDPA or eager attention. Parallelism comes
from what the model itself declares (``parallel/hf/plan.py``): its decoder layers are the FSDP and
activation-checkpointing units, its tensor-parallel plan is translated to ours, its pipeline plan
(or, for GPT-2, one derived from its forward: ``parallel/hf/pp_derive.py``) gives the cut points, and each pipeline stage runs the model's own forward (``parallel/hf/stages.py``:
its masks, positions, rotary tables, scaling and soft-capping). The model is built in
``configure_model()`` (Lightning calls it inside the strategy's init context, possibly on the meta
device); ``parallel_plan()`` works before that from a meta-device copy, so a run can be validated
before any process starts.

Determinism for loss parity: no dropout, and an eager build draws its weights from a generator forked
off the global seed, so every strategy and world size starts from the same weights. Attention is
SDPA by default; ``attn_implementation`` takes ``models/attention.py``'s names: ``eager`` (Gemma-2 supports only
eager) and ``sdpa_flash`` / ``sdpa_efficient`` / ``sdpa_cudnn`` / ``sdpa_math`` (SDPA held to one kernel,
registered with transformers' ``AttentionInterface``) compute the same.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_par.models.attention import HF_KEYS, NAMES, name_of_hf_key, register_with_transformers
from lightning_par.models.module import ParModule
from lightning_par.models.hf.pretrained import build_pretrained, pretrained_config
from lightning_par.parallel.contract import ParallelPlan
from lightning_par.parallel.hf.plan import (
    check_tied,
    hf_init_fn,
    hf_parallel_plan,
    tag_paths,
)
from lightning_par.parallel.init.weights import SafetensorsWeights, check_pretrained

ARCHS = ("gpt2", "llama", "qwen2", "mistral", "gemma2", "gemma3_text")
#: ``attn_implementation``'s names (``models/attention.py``); transformers knows them as ``attention.HF_KEYS``
ATTENTION = NAMES
_DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout",
                 "summary_first_dropout")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError("HFCausalLM needs transformers: pip install 'lightning_par[hf]'") from None
    register_with_transformers()  # the sdpa_* names (idempotent)
    return transformers


def hf_attention_key(attn: Any, model_cls: Any, arch: str) -> str:
    """The transformers key (``attention.HF_KEYS``) of ``attn``, one of ``ATTENTION``; one-line ValueError for
    another name or for an SDPA name (sdpa, sdpa_*) on a family without SDPA support (it gets eager only)."""
    if attn not in ATTENTION:
        raise ValueError(f"HFCausalLM: attn_implementation={attn!r}; choose one of {', '.join(ATTENTION)}")
    if attn != "eager" and not getattr(model_cls, "_supports_sdpa", True):
        raise ValueError(f"HFCausalLM: {arch} does not support attn_implementation={attn}; use eager")
    _transformers()
    return HF_KEYS[attn]


def hf_config(arch: str, *, hidden: int, layers: int, heads: int, kv_heads: int | None, intermediate: int | None,
              vocab: int, max_positions: int, tie_word_embeddings: bool, attn_implementation: str = "sdpa",
              **extra: Any) -> Any:
    """A ``transformers`` config for ``arch`` in our size vocabulary, without dropout, with
    ``attn_implementation`` (``ATTENTION``: sdpa, sdpa_flash, sdpa_efficient, sdpa_cudnn, sdpa_math or eager;
    ``extra`` may name it too, as the YAML's ``config``), held in ``_attn_implementation`` as transformers
    knows it (``attention.HF_KEYS``: sdpa_flash is ``sdpa_fa`` there)."""
    attn = extra.pop("attn_implementation", None) or attn_implementation
    if arch not in ARCHS:
        raise ValueError(f"HFCausalLM: unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if vocab < 256:
        raise ValueError(f"HFCausalLM: vocab={vocab} is below 256, the byte-level text data's alphabet")
    if hidden % heads:
        raise ValueError(f"HFCausalLM: hidden={hidden} is not divisible by heads={heads}")
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(f"HFCausalLM: heads={heads} is not a multiple of kv_heads={kv_heads}")
    if arch == "gpt2":
        if kv_heads not in (None, heads):
            raise ValueError("HFCausalLM: gpt2 has no grouped-query attention; leave kv_heads null")
        sizes = dict(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=intermediate, n_positions=max_positions,
                     bos_token_id=None, eos_token_id=None)
    else:
        sizes = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     head_dim=hidden // heads,  # Gemma's configs default to 256 whatever the width
                     num_key_value_heads=kv_heads or heads, intermediate_size=intermediate or 4 * hidden,
                     max_position_embeddings=max_positions, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = _transformers().AutoConfig.for_model(arch, vocab_size=vocab, tie_word_embeddings=tie_word_embeddings,
                                               use_cache=False, **sizes, **extra)
    for key in _DROPOUT_KEYS:
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    model_cls = _transformers().AutoModelForCausalLM._model_mapping[type(cfg)]
    cfg._attn_implementation = hf_attention_key(attn, model_cls, arch)
    return cfg


class HFCausalLM(ParModule):
    """A Hugging Face causal LM from a config; next-token prediction on ``(B, T)`` token ids.

    Args:
        arch: ``gpt2``, ``llama``, ``qwen2``, ``mistral``, ``gemma2`` or ``gemma3_text``.
        hidden, layers, heads: width, depth and attention heads.
        kv_heads: key/value heads (grouped-query attention; null: = heads). Not for gpt2.
        intermediate: MLP inner size (null: the architecture's default, 4 x hidden).
        vocab: vocabulary size, at least 256 (the text data is byte-level).
        max_positions: longest sequence the model accepts (at least ``seq_len``).
        tie_word_embeddings: share the input embedding with the output projection.
        seq_len: training sequence length (for ``example_input``).
        pretrained: a local ``save_pretrained`` directory: the architecture and every size come from
            its ``config.json`` (``arch`` .. ``tie_word_embeddings`` are then not used) and the weights
            from its safetensors files, each rank reading only its shards (``models/hf/pretrained.py``).
            Dropout stays off; ``config`` still sets further fields.
        attn_implementation: ``sdpa`` (default), ``sdpa_flash``, ``sdpa_efficient``, ``sdpa_cudnn``, ``sdpa_math``
            or ``eager`` (``models/attention.py``; also accepted inside ``config``).
        config: further ``transformers`` config fields (e.g. ``rope_theta``, ``sliding_window``).
        optimizer, lr, weight_decay, betas, momentum: as ``ParModule``.
    """

    input_kind = "tokens"

    def __init__(self, arch: str = "llama", hidden: int = 64, layers: int = 2, heads: int = 4,
                 kv_heads: int | None = None, intermediate: int | None = None, vocab: int = 256,
                 max_positions: int = 128, tie_word_embeddings: bool = False, seq_len: int | None = None,
                 config: dict | None = None, attn_implementation: str = "sdpa", pretrained: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()
        # plain values: a dict- or list-valued field from Hydra (``+model.config.rope_parameters={...}``)
        # arrives as an OmegaConf container, which transformers' config validation refuses
        config = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else config
        self.pretrained = str(pretrained) if pretrained else None
        if self.pretrained:  # architecture and sizes from the checkpoint; checked against its tensors now
            extra = dict(config or {})
            attn = extra.pop("attn_implementation", None) or attn_implementation
            if attn not in ATTENTION:  # before reading the checkpoint: the family is checked below
                hf_attention_key(attn, None, "")
            self.hf_config = pretrained_config(self.pretrained, attn_implementation=HF_KEYS[attn], **extra)
            hf_attention_key(attn, _transformers().AutoModelForCausalLM._model_mapping.get(type(self.hf_config), None),
                            self.hf_config.model_type)
            max_positions = _max_positions(self.hf_config) or seq_len or max_positions
            check_pretrained(self.build_hf("meta"), SafetensorsWeights(self.pretrained))
        self.seq_len = seq_len or max_positions
        if self.seq_len > max_positions:
            raise ValueError(f"HFCausalLM: seq_len={self.seq_len} exceeds max_positions={max_positions}")
        if not self.pretrained:
            self.hf_config = hf_config(arch, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                                       intermediate=intermediate, vocab=vocab, max_positions=max_positions,
                                       tie_word_embeddings=tie_word_embeddings, attn_implementation=attn_implementation,
                                       **dict(config or {}))
        self._plan: ParallelPlan | None = None
        if self.chunked_loss is not None:
            self._check_chunkable()

    def _check_chunkable(self) -> None:
        """``chunked_loss`` on a model whose forward cannot return its hidden states as logits: one line."""
        from lightning_par import ConfigError

        x = torch.zeros(1, 8, dtype=torch.long)
        try:  # on the meta device: the model's own config, no memory
            why = not_chunkable(self.chunk_head(self.build_hf("meta")), x.to("meta"))
        except Exception:  # noqa: BLE001 -- a forward meta cannot run (MoE grouped_mm, .item()): a tiny real copy
            why = self._check_chunkable_tiny(x)
        if why:
            raise ConfigError(f"model.chunked_loss: {self.hf_config.model_type}'s {why}; set chunked_loss=false")

    def _check_chunkable_tiny(self, x: torch.Tensor) -> str | None:
        """``not_chunkable`` on a CPU copy of the family at ``registry.TINY`` sizes with this config's other plain
        fields (soft-capping, scaling factors); an exception of that check: why, in the same words."""
        from lightning_par.models.hf.registry import TINY, TINY_IF_PRESENT, tiny_config

        cfg = self.hf_config
        fields = {k: v for k, v in cfg.to_diff_dict().items() if k not in TINY and k not in TINY_IF_PRESENT
                  and isinstance(v, (bool, int, float, str, type(None))) and k not in ("model_type", "transformers_version")}
        try:
            tiny = tiny_config(cfg.model_type, **fields)
            with torch.random.fork_rng():
                net = _transformers().AutoModelForCausalLM.from_config(tiny, attn_implementation=cfg._attn_implementation)
            return not_chunkable(self.chunk_head(net), x)
        except Exception as e:  # noqa: BLE001 -- the check cannot run: say so rather than train unchecked
            return f"forward could not be checked ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"

    # ------------------------------------------------------------------------ building
    def build_net(self, device: torch.device | str = "meta") -> nn.Module:
        """A fresh copy mapping token ids to logits (used to count FLOPs on the meta device)."""
        return LogitsOnly(self.build_hf(device))

    def build_hf(self, device: torch.device | str = "meta") -> nn.Module:
        """A fresh Hugging Face model (meta: shapes only; else initialised from the global seed)."""
        auto = _transformers().AutoModelForCausalLM
        device = torch.device(device)
        attn = self.hf_config._attn_implementation
        if self.pretrained:  # meta: marked for the strategy to fill from the checkpoint; else loaded whole
            net = build_pretrained(self.hf_config, self.pretrained, device, check=False)
        elif device.type == "meta":
            with torch.device("meta"):
                net = auto.from_config(self.hf_config, attn_implementation=attn)
        else:
            devices = [device] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), torch.device(device):
                torch.manual_seed(torch.initial_seed())  # the same weights whatever ran before
                net = auto.from_config(self.hf_config, attn_implementation=attn)
        tag_paths(net)  # lets the init function place copies of its submodules (hf_plan.hf_init_fn)
        return net

    def configure_model(self) -> None:
        """Build the model once (Lightning's hook; under a meta device context it stays on meta)."""
        if getattr(self, "net", None) is not None:
            return
        device = _current_device()
        self.net = self.chunk_head(self.adapt(self.build_hf(device)))

    @property
    def built(self) -> bool:
        return getattr(self, "net", None) is not None

    def _model(self) -> nn.Module:
        """The built model, or a meta copy for questions about its structure."""
        return self.net if self.built else self.build_hf("meta")

    # ------------------------------------------------------------------------ contract
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.built:
            raise RuntimeError("HFCausalLM: the model is built in configure_model(); call it first")
        return self.net(input_ids=x, attention_mask=meta_causal_mask(x), use_cache=False).logits

    def parallel_plan(self) -> ParallelPlan:
        if self._plan is None:
            plan = hf_parallel_plan(self._model())
            assert plan is not None
            self._plan = plan.prefixed("net")
        return self._plan

    def check_tied(self, *, tp: int = 1, pp: int = 1) -> None:
        """One-line ``ValueError`` when tp/pp would untie the tied embeddings (see ``hf.plan.check_tied``)."""
        check_tied(self._model(), tp=tp, pp=pp)

    def init_weights(self, module: nn.Module) -> None:
        """Initialise the tensors ``module`` (a submodule of ``net`` or a copy of one) owns, as
        ``from_config`` would (``hf.plan.hf_init_fn``)."""
        if getattr(self, "_init", None) is None:  # from a pristine meta copy: the live net may be cut or wrapped
            self._init = hf_init_fn(self.build_hf("meta"))
        self._init(module)

    def example_input(self, batch_size: int, device: torch.device | str = "meta") -> torch.Tensor:
        return torch.zeros(batch_size, self.seq_len, dtype=torch.long, device=device)

    def cost_shape(self, seq_len: int | None = None) -> dict[str, Any]:
        """What the cost model prices this model by (``costs/shape.Shape.of_model`` reads it with
        ``Shape.of_hf``, which refuses a family it has no op-by-op shape for): its transformers config at
        ``seq_len`` tokens (None: the longest sequence the model takes)."""
        return {"family": "hf", "config": self.hf_config, "seq_len": seq_len,
                "loss_chunk": self.chunked_loss.chunk_tokens if self.chunked_loss else 0,
                "attn_implementation": self.attn_implementation, "dropout": 0.0}

    @property
    def attn_implementation(self) -> str:
        """The attention backend in ``models/attention.py``'s names (the config holds transformers' key)."""
        return name_of_hf_key(self.hf_config._attn_implementation)

    def state_dict_keys(self) -> list[str]:
        return list(self._model().state_dict())

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The fine-tuned checkpoint's directory rides in the checkpoint (absolute): ``lightning-par-export``
        copies its ``generation_config.json`` (the source's generation defaults) into the export."""
        if self.pretrained:
            checkpoint["pretrained_dir"] = os.path.abspath(self.pretrained)


class LogitsOnly(nn.Module):
    """A Hugging Face causal LM as a function of token ids to logits. On the meta device it passes an
    explicit causal mask: building the mask itself reads tensor values, which meta tensors lack."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=x, attention_mask=meta_causal_mask(x), use_cache=False).logits


def not_chunkable(net: nn.Module, x: torch.Tensor) -> str | None:
    """Why the chunked loss cannot run on ``net`` (a transformers causal LM whose output layer is already chunked,
    a pass-through), or None: it needs the model to return that layer's result as its logits, so a forward on
    token ids ``x`` must return that very tensor. Soft-capping (Gemma-2), logit scaling (Cohere, Granite) or a
    copy would be skipped by the chunked loss. An exception of the forward propagates."""
    seen: list[torch.Tensor] = []
    hook = net.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        logits = net(input_ids=x, attention_mask=meta_causal_mask(x), use_cache=False).logits
    finally:
        hook.remove()
    if not seen or logits is not seen[-1]:
        return "forward changes the logits after its output layer (soft-capping, scaling), which the chunked loss would skip"
    return None


def meta_causal_mask(x: torch.Tensor) -> torch.Tensor | None:
    """An explicit causal mask for token ids ``x`` on the meta device (a forward there: FLOP counting, float8's
    probe of outputs changed in place); None elsewhere, where the model builds its own."""
    if not x.is_meta:
        return None
    t = x.shape[1]
    return torch.ones(t, t, dtype=torch.bool, device=x.device).tril().expand(x.shape[0], 1, t, t)


def _max_positions(cfg: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(getattr(cfg, key, None), int):
            return getattr(cfg, key)
    return None


def _current_device() -> torch.device:
    """The device new tensors go to now (a ``torch.device`` context, e.g. meta, or the default)."""
    with contextlib.suppress(Exception):
        return torch.empty(()).device
    return torch.device("cpu")
