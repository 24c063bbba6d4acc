"""Process-group start-up under torchrun that survives restarts.

Under torchrun every worker connects to the elastic agent's TCPStore (``TORCHELASTIC_USE_AGENT_STORE``).
After a worker dies and torchrun restarts the group, the new workers find the previous attempt's
keys still in that store -- gloo's full-mesh connect then dials the dead workers' addresses and
either fails ("Connection refused") or hangs in ``init_process_group`` (seen here with torch 2.13).
Prefixing the store with the restart count gives every attempt a clean key space.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist


def init_elastic_process_group(backend: str, *, timeout_s: float = 1800) -> bool:
    """Initialize the default process group for a torchrun worker, one store namespace per attempt.

    Returns False (and does nothing) outside torchrun or when a group already exists.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or dist.is_initialized():
        return False
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    use_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=(rank == 0 and not use_agent_store), timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"lightning_par/attempt{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)
    return True
