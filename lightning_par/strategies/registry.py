"""lightning_par's strategies in Lightning's ``StrategyRegistry``, and one-line configuration errors
for scripts that use them from their own ``Trainer``.

Names mirror the config files (``lp_`` + ``conf/strategy/<name>.yaml``); presets that are a class
with fixed arguments (``hsdp``) register those arguments too.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType

from lightning.pytorch.strategies import StrategyRegistry

from lightning_par import ConfigError


def _entries() -> dict[str, tuple[type, dict, str]]:
    from lightning_par import strategies as s

    return {
        "lp_single": (s.SingleDeviceStrategy, {}, "one device, the reference run"),
        "lp_ddp": (s.DDPStrategy, {}, "data parallel (DistributedDataParallel)"),
        "lp_zero1": (s.Zero1Strategy, {}, "ZeRO-1: optimizer state sharded"),
        "lp_zero2": (s.Zero2Strategy, {}, "ZeRO-2: optimizer state and gradients sharded"),
        "lp_zero3": (s.Zero3Strategy, {}, "ZeRO-3: FSDP2, everything sharded"),
        "lp_zero3_offload": (s.Zero3OffloadStrategy, {}, "ZeRO-3 with CPU offload"),
        "lp_fsdp": (s.FSDPStrategy, {}, "FSDP2 with every knob"),
        "lp_hsdp": (s.FSDPStrategy, {"replicate": 2}, "hybrid sharding: FSDP within 2 replica groups"),
        "lp_pipeline": (s.PipelineStrategy, {}, "pipeline parallel over the model's declared layers"),
        "lp_tensor_parallel": (s.TensorParallelStrategy, {}, "tensor parallel from the model's tp plan"),
        "lp_fsdp_tp": (s.FSDPTPStrategy, {}, "2-D: tensor parallel x FSDP"),
        "lp_3d": (s.Parallel3DStrategy, {}, "3-D: pipeline x tensor x data parallel"),
        "lp_expert_parallel": (s.ExpertParallelStrategy, {}, "MoE experts over an ep axis (all-to-all) x data parallel"),
    }


def register_strategies() -> None:
    for name, (cls, kwargs, description) in _entries().items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=f"lightning_par: {description}", **kwargs)
    _install_config_error_hook()


def _install_config_error_hook() -> None:
    """An uncaught ``ConfigError`` in a script prints one ``error:`` line (from rank 0 only) instead of
    a traceback through Lightning's fit loop; every other exception is left to the previous hook.
    Interactive sessions (IPython, notebooks) use their own display and are not affected."""
    previous = sys.excepthook
    if getattr(previous, "_lightning_par", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if isinstance(value, ConfigError):
            if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":
                # the real stderr: torch's distributed excepthook buffers sys.stderr to prefix "[rankN]"
                sys.__stderr__.write(f"error: {value}\n")
                sys.__stderr__.flush()
            sys.stdout.flush()
            # skip interpreter finalization: with a process group still alive, gloo's threads can
            # hold the exit for many seconds; nothing is left to clean up after a config error
            os._exit(1)
        previous(kind, value, tb)

    hook._lightning_par = True  # type: ignore[attr-defined]
    sys.excepthook = hook
