"""Bytes per parameter of the model states, by precision and optimizer (see docs/cost_model.md).

    precision      p  g  optimizer state per element   master copy
    32-true        4  4  4                              -
    bf16-mixed     4  4  4                              -   (autocast: fp32 weights, bf16 compute)
    16-mixed       4  4  4                              -
    bf16-true      2  2  2                              -
    paper-mixed    2  2  4                              4   (the ZeRO paper's K = 12 for Adam)

Adam/AdamW keep two states (m, v), SGD one (momentum). ``adamw8bit`` is torchao's ``AdamW8bit``
(torchao 0.18, ``torchao/optim/subclass_8bit.py`` and ``adam.py``): a parameter tensor of at least
4096 elements whose size divides by the block (256) gets m and v as uint8 codes plus one fp32 scale
per block of 256 and a 256-entry fp32 quantisation map per state; smaller tensors keep m and v in
the parameter's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning_par.core import dtypes

#: the precisions the estimator models (their dtypes: ``lightning_par/core/dtypes.py``)
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "paper-mixed")
OPTIMIZERS = ("adamw", "adam", "sgd", "adamw8bit")
BLOCK_8BIT = 256  # torchao AdamW8bit's default block_size
MIN_8BIT = 4096  # torchao quantises only tensors of at least this many elements


def _layout(precision: str) -> tuple[int, int, int, int]:
    """(param bytes, grad bytes, bytes per optimizer-state element, master-copy bytes): gradients in
    the parameters' dtype, optimizer state in the master copy's if there is one, else the parameters'."""
    pr = dtypes.precision(precision)
    p = dtypes.dtype_bytes(pr.param)
    master = dtypes.dtype_bytes(pr.master) if pr.master is not None else 0
    return p, p, master or p, master


_STATE_ELEMENTS = {"adamw": 2, "adam": 2, "sgd": 1, "adamw8bit": 2}


def check(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(allowed)}")


def bytes_per_param(precision: str, optimizer: str = "adamw") -> tuple[float, float, float]:
    """(params, grads, optimizer state) bytes per parameter, unsharded: paper-mixed adamw -> (2, 2, 12);
    adamw8bit: 2 x (1 + 4/256) for the bulk of the parameters (see ``optimizer_state_bytes``)."""
    check(precision, PRECISIONS, "precision")
    check(optimizer, OPTIMIZERS, "optimizer")
    p, g, s, master = _layout(precision)
    if optimizer == "adamw8bit":
        return p, g, master + 2 * (1 + 4 / BLOCK_8BIT)
    return p, g, master + _STATE_ELEMENTS[optimizer] * s


def optimizer_state_bytes(n_params: int, optimizer: str, precision: str = "32-true", *,
                          tensor_numels: Iterable[int] | None = None) -> int:
    """Optimizer-state bytes for ``n_params`` parameters (AdamW's scalar ``step`` not counted).

    With ``tensor_numels`` (the element count of every parameter tensor the optimizer holds, e.g.
    a rank's local shards) the count is exact for ``adamw8bit``: tensors of >= 4096 elements that
    divide by 256 are quantised (1 byte + 4/256 per element, + 1 KiB quantisation map per state),
    the others keep two states in the parameter's dtype."""
    p, _, k = bytes_per_param(precision, optimizer)
    if optimizer != "adamw8bit" or tensor_numels is None:
        return int(round(n_params * k))
    master = _layout(precision)[3]
    total = 0
    for numel in tensor_numels:
        if numel >= MIN_8BIT and numel % BLOCK_8BIT == 0:
            total += 2 * (numel + 4 * (numel // BLOCK_8BIT) + 4 * 256)
        else:
            total += 2 * numel * p
        total += master * numel
    return total


#: parameter bytes per chunk of the disk tier's paged optimizer step (``Zero3OffloadStrategy.offload_chunk_mb``)
DISK_CHUNK_BYTES = 64 * 2**20


def disk_tier_resident(states_bytes: float, elems: float, largest_elems: float,
                       chunk_bytes: float = DISK_CHUNK_BYTES, param_bytes: float = 4) -> int:
    """Host bytes the disk tier (``parallel/sharding/disk_offload.py``) keeps of ``states_bytes`` of offloaded
    states over ``elems`` parameters: its optimizer step pages in one chunk (``chunk_bytes`` of
    parameters, at least the largest parameter) while it prefetches the next and releases the one
    before, each with its parameters, gradients and optimizer state. The rest stays on disk."""
    if elems <= 0 or states_bytes <= 0:
        return 0
    chunk = max(chunk_bytes / param_bytes, largest_elems)
    return int(min(states_bytes, 3 * chunk * states_bytes / elems))


def nf4_bytes(numel: int, dtype_bytes: int, *, gathered: bool = False) -> int:
    """Bytes of one weight of ``numel`` elements stored as torchao's ``NF4Tensor`` (torchao 0.18, ``nf4_tensor.py``)
    with the block sizes QLoRA's ``lora.base=nf4`` gives it (``parallel/adapters/lora.nf4_blocks``: 64 values per
    block, up to 256 blocks per scale group): the packed codes (n / 2, uint8), the blocks' int8 scalers (n / 64), one
    scale per group and the scalers' mean in the weight's dtype, and the 16-entry code table in that dtype (each
    tensor its own): about 0.52 bytes per value. Storage bytes, as the memory callback counts them: a weight of one
    group keeps its group's row of scales. ``gathered``: what FSDP2 all-gathers of it (torchao's
    ``fsdp_pre_all_gather``: the codes, the scalers and the group scales). Checked to the byte against the
    tensors' storages and a run's all-gathers (tests/test_lora_costs.py). A weight NF4 cannot hold (its size not a
    multiple of 64) is counted in its dtype."""
    from lightning_par.parallel.adapters.lora import nf4_blocks

    try:
        block, per_group = nf4_blocks(numel)
    except ValueError:
        return numel * dtype_bytes
    blocks = numel // block
    groups = blocks // per_group
    if gathered:
        return numel // 2 + blocks + dtype_bytes * groups
    # the group scales: a view of a (groups, per_group) tensor, copied out where there are several
    return numel // 2 + blocks + dtype_bytes * ((groups if groups > 1 else per_group) + 1 + 16)
