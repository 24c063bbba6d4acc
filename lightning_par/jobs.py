"""What a Hydra job leaves behind when it fails: ``error.json`` in its output directory.

``run.py``'s ``main`` calls ``record_failure`` when a job raises. In a sweep (``-m``) the exception
is then handed back to Hydra, which marks the job failed, runs the remaining jobs, and ends the
sweep with a nonzero exit; ``experiments/report.py`` lists every ``error.json`` under the sweep
directory next to the summaries of the jobs that worked. A single run keeps its one-line error and
exit status 2 for configuration mistakes.

error.json: ``{"error": one-line message, "type": exception class name, "overrides": [the job's
command-line overrides], "rank": global rank that wrote it}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ERROR_FILE = "error.json"
_RANK_ENV = ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK")


def global_rank() -> int:
    """This process's global rank from the launcher's environment (0 when none is set)."""
    for key in _RANK_ENV:
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def root_error(exc: BaseException) -> BaseException:
    """The error worth reporting: Hydra's ``InstantiationException`` ("Error in call to target ...")
    is unwrapped to the exception the constructor raised."""
    seen = {id(exc)}
    while type(exc).__name__ == "InstantiationException" and exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def one_line(exc: BaseException, limit: int = 500) -> str:
    """The exception's message on one line (its lines joined, at most ``limit`` characters; the class
    name when there is no message)."""
    line = " ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip()) or type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def hydra_job() -> dict[str, Any]:
    """The current Hydra job: output dir, overrides and whether it belongs to a multirun; empty
    outside Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return {}
        hc = HydraConfig.get()
        return {"output_dir": str(hc.runtime.output_dir), "overrides": [str(o) for o in hc.overrides.task],
                "multirun": hc.mode == RunMode.MULTIRUN, "num": hc.job.get("num")}
    except Exception:  # never let bookkeeping hide the real error
        return {}


def record_failure(exc: BaseException, output_dir: str | os.PathLike | None = None,
                   overrides: list[str] | None = None) -> Path | None:
    """Write ``error.json`` for a failed job (rank 0 writes it; other ranks only when rank 0 has
    not). Returns the path, or None when there is nowhere to write."""
    job = hydra_job()
    out = output_dir if output_dir is not None else job.get("output_dir")
    if out is None:
        return None
    path = Path(out) / ERROR_FILE
    rank = global_rank()
    if rank != 0 and path.exists():
        return path
    exc = root_error(exc)
    record = {"error": one_line(exc), "type": type(exc).__name__,
              "overrides": list(overrides if overrides is not None else job.get("overrides", [])), "rank": rank}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{ERROR_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        return None
    return path

