"""The checkpoint error and how its one line is cut from a library's message (shared by the DCP
checkpoints, ``checkpoint.py``, and Lightning's single files, ``lightning_file.py``)."""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException

from lightning_par import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from (missing, incomplete, damaged); one line naming the file."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint that could not be written (a full disk, a failed write); one line naming the directory,
    its free space and what a checkpoint of the run takes. The partial checkpoint has been removed."""


def _cause(exc: BaseException, limit: int = 200) -> str:
    """The informative line of ``exc``'s message (torch's safe-loading errors bury it mid-text; DCP
    wraps each rank's error with its traceback)."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and failures:
        rank, wrapped = min(failures.items(), key=lambda item: item[0])
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {type(inner).__name__}: {_cause(inner, limit)}"
    text = " ".join(str(exc).split())
    for marker in ("Unsupported global:", "Unsupported operand"):
        if marker in text:
            text = text[text.index(marker):]
            break
    text = text.split(". ", 1)[0] or type(exc).__name__  # the first sentence
    return text if len(text) <= limit else text[: limit - 3] + "..."
