"""Run a function on N CPU processes with a gloo process group, bounded in time.

Each rank gets a free port (chosen fresh per call, so back-to-back runs never reuse one), one
torch thread (N ranks share two cores), and a hard timeout: a hung collective fails the test
instead of hanging the suite. Return values come back per rank; an exception in any rank is
re-raised in the parent with that rank's traceback.

The ranks are forked from a fork server (``multiprocessing``'s ``forkserver``, one per pytest worker,
shared with the tests' programs: ``tests/launch.py``) that imported torch, torch.distributed,
lightning_par's techniques and transformers once: a rank starts
in a fraction of a second instead of importing them again (several seconds of CPU each, on two cores
shared by every rank of the suite). The server forks from a process that has run no torch operation,
so no thread pool is copied into a rank.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context():  # noqa: ANN202 -- the fork server shared with the tests' programs (tests/launch.py)
    from tests import launch

    return launch.context()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be importable (defined at module level) because the ranks are spawned.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    except Exception as exc:  # queue.Empty: a rank hung or died without reporting
        errors.append(f"timed out after {timeout}s waiting for ranks ({type(exc).__name__}); "
                      f"finished: {sorted(results)}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
