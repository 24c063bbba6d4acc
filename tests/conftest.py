import functools
import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _single_thread_and_clean_pg():
    torch.set_num_threads(1)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# The suite runs on two pytest-xdist workers (``-n 2 --dist loadgroup`` in pyproject.toml): a run of
# N ranks spends much of its time in one process at a time -- rank 0 importing torch, Lightning and
# transformers, then each child doing the same while rank 0 waits at the rendezvous -- so a second
# test fills the idle core. The multirun sweeps in ``tests/sweeps.py`` are cached per test session,
# and a worker is a session: every module that reads them is one group, run by one worker, so each
# sweep still runs once. Every other module is a group of its own: xdist hands ungrouped tests out
# one at a time, alternately, so a module's tests landed on both workers and each worker built the
# module's fixtures -- the multi-process runs a module shares among its tests (the family matrix's
# references, the export test's trained checkpoints, ...) ran twice.
@functools.lru_cache(maxsize=None)
def _reads_shared_sweeps(path: str) -> bool:
    """Whether the test module at ``path`` uses ``tests/sweeps.py`` (imports it, at the top or in a test)."""
    with open(path) as f:
        return "tests.sweeps" in f.read()


@pytest.hookimpl(wrapper=True)  # before every plain implementation, xdist's (which reads the group marks) too:
def pytest_collection_modifyitems(config, items):  # a tryfirst one ran after it under pytest 9.2
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:  # a module that names its group itself
            continue
        group = "shared_sweeps" if _reads_shared_sweeps(str(item.path)) else item.path.stem
        item.add_marker(pytest.mark.xdist_group(group))
    return (yield)
