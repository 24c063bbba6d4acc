"""The token file's format, shared by ``lightning-par-prepare`` (which writes it) and ``data=tokens`` (which
memory-maps it): numpy only -- so the prepare command and its workers need not import Lightning and torch.

File format (one file, little-endian; nanoGPT/Megatron style -- a fixed header, then the raw ids)::

    offset  size  field
    0       8     magic   b"LPTOKENS"
    8       4     version uint32 (1)
    12      4     dtype   uint32: bytes per token, 2 (uint16) or 4 (uint32)
    16      8     n_tokens uint64
    24      8     vocab_size uint64 (0: unknown; then the sidecar's, if any)
    32      32    reserved (zeros): the tokens start 64-aligned, so any dtype view of them is aligned
    64      ...   n_tokens ids of that dtype; the file's size must be exactly 64 + n_tokens * dtype

An optional sidecar ``<file>.json`` (written by prepare: ``vocab_size``, ``eos_id``, the tokenizer
directory, source files) is read for what the header lacks; a glob matching sidecars skips them.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_par import ConfigError

MAGIC = b"LPTOKENS"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ32x")  # magic, version, dtype code, n_tokens, vocab_size, reserved
HEADER_BYTES = HEADER.size  # 64
DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}  # dtype code (bytes per token) -> numpy dtype


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab_size <= 65536, ids up to 65535), else uint32."""
    return DTYPES[2] if vocab_size <= 2**16 else DTYPES[4]


def pack_header(n_tokens: int, dtype: np.dtype, vocab_size: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, np.dtype(dtype).itemsize, n_tokens, vocab_size)


@dataclass(frozen=True)
class TokenFile:
    """One token file as its header describes it (checked against the file's size)."""

    path: str
    dtype: np.dtype
    n_tokens: int
    vocab_size: int

    @classmethod
    def open(cls, path: str) -> TokenFile:
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(HEADER_BYTES)
        except OSError as e:
            raise ConfigError(f"cannot read token file {path}: {e.strerror or e}") from None
        if len(head) < HEADER_BYTES or head[:8] != MAGIC:
            raise ConfigError(f"{path} is not a token file (no {MAGIC.decode()} header; write one with "
                              "lightning-par-prepare)")
        _, version, code, n_tokens, vocab_size = HEADER.unpack(head)
        if version != VERSION or code not in DTYPES:
            raise ConfigError(f"{path}: unsupported token file (version {version}, dtype code {code}; "
                              f"this reads version {VERSION}, dtype codes 2 and 4)")
        expected = HEADER_BYTES + n_tokens * code
        if size != expected:
            what = "truncated" if size < expected else "longer than its header says"
            raise ConfigError(f"{path}: {what} ({size} bytes, header says {n_tokens} tokens = {expected} bytes)")
        return cls(path, DTYPES[code], n_tokens, vocab_size)

    def sidecar(self) -> dict[str, Any]:
        """``<file>.json`` if prepare wrote one (vocab_size, eos_id, ...); {} otherwise."""
        try:
            with open(self.path + ".json") as f:
                meta = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise ConfigError(f"{self.path}.json: unreadable sidecar ({e})") from None
        return meta if isinstance(meta, dict) else {}
