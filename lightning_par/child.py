"""Entry of ranks 1..N-1 started by lightning_par's launcher: ``python -m lightning_par.child CONFIG``.

It trains the one job described by the resolved config file (no Hydra, no sweep); the launcher has
set LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in its environment.
"""

from __future__ import annotations

import os
import sys

from omegaconf import OmegaConf

from lightning_par.train import train


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m lightning_par.child RESOLVED_CONFIG.yaml")
    train(OmegaConf.load(argv[0]), child=True)
    # The work is done and the process group destroyed. Skip interpreter finalization: gloo's
    # worker threads can still be releasing tensors then, which aborts the process now and then
    # ("terminate called without an active exception") and would turn a finished rank into a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
