"""Entry of ranks 1..N-1 started by lightning_par's launcher: ``python -m lightning_par.run.child CONFIG``,
or its ``main`` in a rank forked from the launcher's fork server (a CPU job: ``core/fork_ranks.py``).

It trains the one job described by the resolved config file (no Hydra, no sweep); the launcher has
set LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in its environment. The launching process checked
the config's values before it started this rank (``config_values.check_config_values``, once per launch):
``train(cfg, child=True)`` does not check them again, only what needs the built objects. A failure prints nothing:
rank 0 reports every failure once, naming the rank (an error all ranks raised alike, such as a stop on
a signal, is rank 0's own; this rank's own error goes to a file its launcher reads,
``jobs.record_rank_failure``, and an unexpected one's traceback to the job's run.log,
``jobs.log_traceback``). The exit status is nonzero: 128 + the signal after a stop on one, 1
otherwise.
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
        raise SystemExit("usage: python -m lightning_par.run.child RESOLVED_CONFIG.yaml")
    cfg = OmegaConf.load(argv[0])
    try:
        from lightning_par.run.train import train

        train(cfg, child=True)
    except BaseException as e:  # noqa: BLE001 -- whatever ended this rank, rank 0 reports it
        from lightning_par import ConfigError
        from lightning_par.core.jobs import log_traceback, record_rank_failure, root_error

        code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
        if code and not getattr(e, "all_ranks", False):
            output_dir = cfg.get("paths", {}).get("output_dir")
            record_rank_failure(e, output_dir)
            if output_dir and not isinstance(root_error(e), (ConfigError, SystemExit, KeyboardInterrupt)):
                log_traceback(e, output_dir)  # this rank's traceback in the job's run.log
        _exit(code)
    _exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
