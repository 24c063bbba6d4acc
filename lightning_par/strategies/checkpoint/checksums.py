"""Checksums of a sharded checkpoint's files: written at save, verified before a run resumes from it.

Why our own: ``torch.distributed.checkpoint`` stores raw bytes with no checksum, so bytes garbled in
place (same size) loaded without complaint and the run trained on corrupt weights until its loss went
non-finite. Each rank hashes the shard files it wrote (``__<rank>_<n>.distcp``, DCP's naming), rank 0
adds ``.metadata`` and ``meta.pt`` and writes ``checksums.json`` last, after every file it lists::

    {"algorithm": "sha256", "files": {"__0_0.distcp": "<hex>", ".metadata": "<hex>", ...}}

Verification reads every listed file once (sha256 runs at about 1 GB/s per core here; files are hashed
on a few threads, hashlib releases the GIL) and is done once per process and checkpoint. A checkpoint
saved before checksums were written has no ``checksums.json``: it still loads, with a note that its
contents cannot be verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHECKSUM_FILE = "checksums.json"
ALGORITHM = "sha256"
_CHUNK = 8 << 20
#: (checkpoint, mtime of its checksums.json) already verified or noted by this process
_DONE: set[tuple[str, float | None]] = set()


def file_digest(path: Path) -> str:
    h = hashlib.new(ALGORITHM)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def digests(directory: Path, names: list[str]) -> dict[str, str]:
    """``name -> hex digest`` of the files ``names`` in ``directory``, hashed on a few threads."""
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(4, len(names))) as pool:
        return dict(zip(names, pool.map(lambda n: file_digest(directory / n), names)))


def own_shard_files(directory: Path, rank: int) -> list[str]:
    """The shard files global rank ``rank`` wrote into ``directory`` (DCP names them ``__<rank>_<n>.distcp``)."""
    prefix = f"__{rank}_"
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(prefix) and p.name.endswith(".distcp"))


def write_checksums(directory: Path, files: dict[str, str]) -> None:
    """``checksums.json`` (atomically: a checkpoint cut off here has none, like one saved before checksums)."""
    tmp = directory / f".{CHECKSUM_FILE}.tmp"
    tmp.write_text(json.dumps({"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, indent=1) + "\n")
    os.replace(tmp, directory / CHECKSUM_FILE)


def verify(directory: Path, error: type[Exception]) -> None:
    """Raise ``error`` (one line naming the file) when a file ``checksums.json`` lists is missing or its
    contents differ from what was saved; print a one-line note when the checkpoint has no checksums."""
    record = directory / CHECKSUM_FILE
    key = (str(directory.resolve()), record.stat().st_mtime if record.is_file() else None)
    if key in _DONE:
        return
    if not record.is_file():
        print(f"note: checkpoint {directory} has no {CHECKSUM_FILE} (saved before lightning_par recorded "
              "checksums): its shard contents cannot be verified", file=sys.stderr, flush=True)
        _DONE.add(key)
        return
    try:
        saved = json.loads(record.read_text())
        algorithm, files = saved["algorithm"], dict(saved["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise error(f"checkpoint file {record} is damaged: {type(e).__name__}") from None
    if algorithm != ALGORITHM:
        raise error(f"checkpoint file {record} uses checksum algorithm {algorithm!r}; this version reads {ALGORITHM}")
    for name in files:
        if not (directory / name).is_file():
            raise error(f"checkpoint file {directory / name} is missing (listed in {record})")
    found = digests(directory, sorted(files))
    for name in sorted(files):
        if found[name] != files[name]:
            raise error(f"checkpoint file {directory / name} is damaged: its contents differ from those saved "
                        f"({ALGORITHM} recorded in {record})")
    _DONE.add(key)
