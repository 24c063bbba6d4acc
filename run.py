"""lightning_par entry point: pick a strategy with one word.

    python run.py                                        # small GPT on stdlib text, one device
    python run.py strategy=ddp trainer.devices=2         # 2 processes (gloo on CPU, NCCL on GPU)
    python run.py -m strategy=single,ddp trainer.devices=2   # sweep: one output dir per job
    python run.py mode=estimate model=gpt2_xl trainer.devices=64   # memory table, no training
    torchrun --nproc-per-node=2 --max-restarts=3 run.py strategy=ddp callbacks=checkpoint ckpt_path=auto

Every run writes summary.json (see README) into its Hydra output directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from lightning_par import ConfigError

CONF_DIR = Path(__file__).resolve().parent / "lightning_par" / "conf"
GROUPS = ("strategy", "model", "data", "trainer", "callbacks", "logger", "experiment", "paths")


def check_group_choices(argv: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Reject unknown config names (``strategy=zer3``) in one line, listing the choices, before Hydra
    composes anything; sweeps (``strategy=ddp,zero1``) are checked value by value."""
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key not in GROUPS or value in ("null", ""):
            continue
        values = value[len("choice("):-1].split(",") if value.startswith("choice(") else value.split(",")
        known = sorted(p.stem for p in (conf_dir / key).glob("*.yaml"))
        for v in values:
            if v.strip() not in known:
                raise ConfigError(f"unknown {key} {v.strip()!r}; choose from: {', '.join(known)}")


@hydra.main(version_base="1.3", config_path="lightning_par/conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    # A failed job leaves error.json in its output dir (lightning_par/jobs.py). A single run exits 2 on
    # a configuration mistake; in a sweep the error goes back to Hydra, which marks this job failed,
    # runs the others and ends with a nonzero exit (sys.exit here would stop the whole sweep).
    from lightning_par.jobs import hydra_job, record_failure

    try:
        if cfg.mode == "estimate":
            from lightning_par.estimate import run_estimate

            run_estimate(cfg)
            return None
        if cfg.mode != "train":
            raise ConfigError(f"unknown mode {cfg.mode!r}; choose from: train, estimate")
        from lightning_par.train import train

        summary = train(cfg)
        return summary["final_loss"] if summary else None
    except ConfigError as e:
        record_failure(e)
        print(f"error: {e}", file=sys.stderr)
        if hydra_job().get("multirun"):
            raise
        sys.exit(2)
    except Exception as e:
        record_failure(e)
        raise


def torchrun_overrides(argv: list[str], env: dict[str, str]) -> list[str]:
    """Under torchrun every rank runs this script: give them one shared run directory (named by
    torchrun's run id, stable across restarts, so a restarted run finds its checkpoints), and let
    only rank 0 write Hydra's files."""
    if "TORCHELASTIC_RUN_ID" not in env or any(a.startswith("-m") or a == "--multirun" for a in argv):
        return []
    extra = []
    if not any(a.startswith("hydra.run.dir=") for a in argv):
        extra.append(f"hydra.run.dir=outputs/torchrun/{env['TORCHELASTIC_RUN_ID']}")
    if env.get("RANK", "0") != "0":
        extra.append("hydra.output_subdir=null")
    return extra


if __name__ == "__main__":
    try:
        check_group_choices(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.argv += torchrun_overrides(sys.argv[1:], dict(os.environ))
    main()
