"""Entry of ranks 1..N-1 started by lightning_par's launcher: ``python -m lightning_par.child CONFIG``.

It trains the one job described by the resolved config file (no Hydra, no sweep); the launcher has
set LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in its environment. A failure prints one
``error:`` line (rank 0 reports the job's failure in error.json; this rank writes it only where rank
0 has not) and exits nonzero: 143 after a stop on SIGTERM, 1 otherwise.
"""

from __future__ import annotations

import os
import sys

from omegaconf import OmegaConf


def _exit(code: int) -> None:
    # Skip interpreter finalization: gloo's worker threads can still be releasing tensors then, which
    # aborts the process now and then ("terminate called without an active exception") and would turn
    # a finished rank into a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m lightning_par.child RESOLVED_CONFIG.yaml")
    cfg = OmegaConf.load(argv[0])
    try:
        from lightning_par.train import train

        train(cfg, child=True)
    except BaseException as e:  # noqa: BLE001 -- one line, whatever ended this rank
        from lightning_par.jobs import global_rank, one_line, record_failure, root_error

        cause = root_error(e)
        code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
        if code:
            record_failure(e, cfg.get("paths", {}).get("output_dir"), overrides=[])
            print(f"error: rank {global_rank()}: {type(cause).__name__}: {one_line(cause)}", file=sys.stderr)
        _exit(code)
    _exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
