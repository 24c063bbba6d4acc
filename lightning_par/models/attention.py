"""The attention backend choice, one vocabulary for our GPT / MoE and for Hugging Face causal LMs
(``model.attn_implementation``).

- ``sdpa``: ``F.scaled_dot_product_attention``, torch picks the kernel per call; everywhere (the default).
- ``sdpa_flash``: SDPA held to the flash kernel; CUDA compute capability >= 8.0 with fp16/bf16, or torch's
  CPU flash kernel (no dropout there).
- ``sdpa_efficient``: SDPA held to the memory-efficient kernel; CUDA only (bf16 from capability 8.0).
- ``sdpa_cudnn``: SDPA held to cuDNN's fused attention; CUDA only, capability >= 8.0, fp16/bf16.
- ``sdpa_math``: SDPA held to its math path (composite ops; torch upcasts fp16/bf16 q, k, v to fp32); everywhere.
- ``eager``: softmax(Q K^T / sqrt(d)) V written out (the softmax in fp32, as transformers' eager); everywhere.

The restriction (``torch.nn.attention.sdpa_kernel``) is entered inside each attention call
(``attend``), so activation checkpointing's recompute in backward runs the same kernel as the
forward: a context around the training step would not cover that recompute.

``eager`` and ``sdpa_math`` materialise the ``B x heads x T x T`` scores and keep the softmax output
for backward (``costs/activations.py`` prices it); flash, memory-efficient and cuDNN kernels keep only
the output and a logsumexp per head and row.

Hugging Face models: ``register_with_transformers`` adds the ``sdpa_*`` names to transformers'
``AttentionInterface`` (transformers' own sdpa function inside ``sdpa_kernel``) and to its
``AttentionMaskInterface`` (its sdpa mask function, so the mask handling is sdpa's exactly). One
name differs there: transformers treats any implementation whose name contains ``flash`` as a request
for the flash-attn package or a Hub kernel, so ``sdpa_flash`` is registered as ``sdpa_fa``
(``HF_KEYS``; ``config._attn_implementation`` holds that key, ``name_of_hf_key`` maps it back).

Layer 1: torch (``core/dtypes.py`` for the check before launch); transformers is imported by
``register_with_transformers`` alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

#: the vocabulary, in the order the docs list it
NAMES = ("sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "eager")
#: the one SDPA backend each restricted name allows (``sdpa`` lets torch choose; ``eager`` is no SDPA)
BACKENDS: dict[str, SDPBackend] = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}
#: names that run on CPU (torch 2.13, measured: the efficient and cuDNN kernels are CUDA's only)
CPU_NAMES = ("sdpa", "sdpa_flash", "sdpa_math", "eager")
#: CUDA compute capability the flash and cuDNN kernels need (torch's sdp_utils: sm80 and newer)
MIN_CAPABILITY = {"sdpa_flash": (8, 0), "sdpa_cudnn": (8, 0), "sdpa_efficient": (5, 0)}
#: the name transformers knows each ``sdpa_*`` name by (``AttentionInterface``): a name containing "flash"
#: is read by transformers as a flash-attn package / Hub kernel request, so sdpa_flash is registered as sdpa_fa
HF_KEYS = {"sdpa": "sdpa", "sdpa_flash": "sdpa_fa", "sdpa_efficient": "sdpa_efficient", "sdpa_cudnn": "sdpa_cudnn",
           "sdpa_math": "sdpa_math", "eager": "eager"}


def check_name(name: Any, what: str = "attn_implementation") -> str:
    """``name`` if it is in the vocabulary, else a one-line ValueError listing it."""
    if name not in NAMES:
        raise ValueError(f"{what}={name!r} is not an attention implementation; choose one of {', '.join(NAMES)}")
    return str(name)


def name_of_hf_key(key: str | None) -> str:
    """Our name for a transformers ``config._attn_implementation`` (``sdpa_fa`` -> ``sdpa_flash``; None: sdpa,
    transformers' default). A key outside the vocabulary (``flash_attention_2``, ``flex_attention``) comes back
    unchanged: the caller decides whether to refuse it."""
    if key is None:
        return "sdpa"
    return next((name for name, k in HF_KEYS.items() if k == key), key)


def backend(name: str) -> SDPBackend | None:
    """The SDPA backend ``name`` restricts to (None: ``sdpa``, torch chooses; or ``eager``)."""
    return BACKENDS.get(check_name(name))


def attend(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
           is_causal: bool = False, attn_mask: torch.Tensor | None = None, scale: float | None = None,
           enable_gqa: bool = False) -> torch.Tensor:
    """Attention of ``q`` (B, heads, T, D) over ``k``/``v`` (B, kv_heads, S, D) as ``name`` computes it, with
    ``F.scaled_dot_product_attention``'s arguments and result. The backend restriction is entered here, inside
    the call, so a checkpointed block's recompute picks the same kernel."""
    if name == "eager":
        return eager_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, attn_mask=attn_mask, scale=scale,
                               enable_gqa=enable_gqa)
    kwargs = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    if enable_gqa:
        kwargs["enable_gqa"] = True
    chosen = backend(name)
    if chosen is None:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(chosen):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
                    is_causal: bool = False, attn_mask: torch.Tensor | None = None, scale: float | None = None,
                    enable_gqa: bool = False) -> torch.Tensor:
    """softmax(Q K^T * scale + mask) V written out, as transformers' eager attention computes it: the softmax
    in fp32 and cast back to q's dtype. Saved for backward: q and k (the scores' matmul), the fp32 softmax
    output (and its cast when q is 16-bit), the dropout mask and the dropped probabilities, and v. The causal
    mask is added as a 0 / -inf bias (an addition saves nothing; a masked_fill would keep its T x T mask)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    t, s = q.shape[-2], k.shape[-2]
    if is_causal:
        scores = scores + torch.full((t, s), float("-inf"), device=q.device, dtype=scores.dtype).triu(1)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, device=q.device, dtype=scores.dtype).masked_fill(
                attn_mask.logical_not(), float("-inf"))
        scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, v)


# ---------------------------------------------------------------------------------------------- before launch
def device_refusal(name: str, device: str, *, compute_dtype: torch.dtype | None = None, dropout: float = 0.0,
                   capability: tuple[int, int] | None = None) -> str | None:
    """Why ``name`` cannot run on ``device`` (an accelerator: ``cpu``, ``cuda``, ...), in words, or None.

    CPU (measured on torch 2.13 with a tiny call per name): sdpa, sdpa_flash, sdpa_math and eager run;
    the memory-efficient and cuDNN kernels are CUDA's only; the CPU flash kernel has no dropout.
    CUDA (``capability``: ``torch.cuda.get_device_capability()``; torch's ``sdp_utils``): flash and cuDNN need
    compute capability 8.0 or more and fp16/bf16 inputs (``compute_dtype``), the memory-efficient kernel 5.0
    (bf16: 8.0). Limits that depend on the call (head dim, masks, cuDNN's layouts) are torch's to refuse at
    run time. Other devices (mps, xpu): only sdpa and eager are vouched for."""
    check_name(name)
    if name in ("sdpa", "eager"):
        return None
    if device == "cpu":
        if name not in CPU_NAMES:
            return f"{name} is a CUDA kernel (CPU runs {', '.join(CPU_NAMES)})"
        if name == "sdpa_flash" and dropout > 0:
            return (f"torch's CPU flash kernel has no dropout (dropout={dropout}); use sdpa (math path with dropout) "
                    "or sdpa_math")
        return None
    if device != "cuda":
        return None if name == "sdpa_math" else f"{name} is checked for CPU and CUDA only, not {device}; use sdpa"
    low_precision = compute_dtype in (torch.float16, torch.bfloat16)
    if name in ("sdpa_flash", "sdpa_cudnn") and compute_dtype is not None and not low_precision:
        return (f"{name} takes fp16/bf16 inputs only, and the run computes in {str(compute_dtype).split('.')[-1]}; "
                "use bf16-mixed / bf16-true precision, or sdpa / sdpa_efficient")
    need = MIN_CAPABILITY.get(name)
    if name == "sdpa_efficient" and compute_dtype == torch.bfloat16:
        need = (8, 0)
    if need is not None and capability is not None and tuple(capability) < need:
        return (f"{name} needs an NVIDIA GPU of compute capability {need[0]}.{need[1]} or more; this one is "
                f"{capability[0]}.{capability[1]}")
    return None


def check_device(name: str, device: str, *, precision: str | None = None, dropout: float = 0.0) -> None:
    """``device_refusal`` as a one-line ValueError naming the key; ``precision`` is Lightning's string (its compute
    dtype is what the kernels receive). On CUDA the capability of device 0 is read (as float8's check does)."""
    compute = None
    if precision is not None:
        from lightning_par.core.dtypes import precision as precision_of

        try:
            compute = precision_of(precision).compute
        except ValueError:  # a precision string the dtype table does not know: its own check names it
            compute = None
    capability = None
    if device == "cuda" and check_name(name) in MIN_CAPABILITY and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(0)
    why = device_refusal(name, device, compute_dtype=compute, dropout=dropout, capability=capability)
    if why:
        raise ValueError(f"attn_implementation={name} cannot run on {device}: {why}")


# ---------------------------------------------------------------------------------------------- transformers
def _restricted(name: str, sdpa_forward: Callable) -> Callable:
    """transformers' sdpa attention function (``sdpa_forward``) held to ``name``'s backend."""
    chosen = BACKENDS[name]

    def forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                **kwargs: Any) -> Any:
        with sdpa_kernel(chosen):
            return sdpa_forward(module, query, key, value, attention_mask, **kwargs)

    forward.__name__ = forward.__qualname__ = f"{name}_attention_forward"
    return forward


_REGISTERED = False


def register_with_transformers() -> None:
    """Add the ``sdpa_*`` names (as ``HF_KEYS`` spells them) to transformers' ``AttentionInterface``: its own
    sdpa attention function inside ``sdpa_kernel(backend)``; and to its ``AttentionMaskInterface`` with its
    sdpa mask function, so masks are built exactly as for ``sdpa`` (a name without a mask function gets no
    mask at all: transformers' ``_preprocess_mask_arguments`` exits early). ``from_config(...,
    attn_implementation=key)`` then accepts the key (it checks ``AttentionInterface``'s keys, and a key
    containing ``sdpa`` gets sdpa's support check: a family without sdpa is refused). Idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    for name in BACKENDS:
        AttentionInterface.register(HF_KEYS[name], _restricted(name, sdpa_attention_forward))
        AttentionMaskInterface.register(HF_KEYS[name], sdpa_mask)
    _REGISTERED = True
