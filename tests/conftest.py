import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")


#: torch.distributed's launch variables: a test that leaves one set in its worker makes every later run started
#: from that worker (a script, run.py) believe it is one rank of a job started externally, and wait for peers
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


@pytest.fixture(autouse=True)
def _single_thread_and_clean_pg():
    torch.set_num_threads(1)
    launch_env = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    left = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    if left != launch_env:
        for k, v in launch_env.items():  # restored, so that the tests after it run as they should
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        pytest.fail(f"the test changed torch.distributed's launch variables in this process: {launch_env} -> {left}")


# The suite runs on two pytest-xdist workers (``-n 2 --dist loadgroup`` in pyproject.toml): a run of
# N ranks spends much of its time in one process at a time -- rank 0 importing torch, Lightning and
# transformers, then each child doing the same while rank 0 waits at the rendezvous -- so a second
# test fills the idle core. Every module is a group of its own: xdist hands ungrouped tests out one at
# a time, alternately, so a module's tests landed on both workers and each worker built the module's
# fixtures -- the multi-process runs a module shares among its tests (the family matrix's references,
# the export test's trained checkpoints, ...) ran twice. The multirun sweeps that several modules read
# (``tests/sweeps.py``) are shared by both workers through one directory made here, before the workers
# start, and a lock per sweep. (They were one group of ten modules, all on one worker.)
#: the modules that take longest, handed out first so that neither worker is left with a long module at the end
#: (``--no-loadscope-reorder`` in pyproject.toml keeps this order: xdist would otherwise hand out the groups with
#: the most tests first). The full suite on 2026-11-28 (bbf94e3, summed per module), with the modules whose runs
#: now share processes (tests/serial.py, sweeps.together) scaled by what that saved each on its own: to be
#: measured again at the next full run.
LONGEST_FIRST = ("test_comm", "test_hf", "test_advisor", "test_float8", "test_family_matrix", "test_faults",
                 "test_estimate_rss", "test_recipes", "test_signals", "test_compile", "test_optim", "test_pretrained",
                 "test_moe", "test_e2e_model_parallel", "test_batch_size", "test_hf_moe_ep_fsdp", "test_chunked_loss")


def pytest_configure(config):
    if not hasattr(config, "workerinput") and "LP_SWEEP_DIR" not in os.environ:  # the controller (or -n 0)
        import tempfile

        os.environ["LP_SWEEP_DIR"] = tempfile.mkdtemp(prefix="lp_sweeps_")  # the workers inherit it
        config._lp_sweep_dir = os.environ["LP_SWEEP_DIR"]


def pytest_unconfigure(config):
    made = getattr(config, "_lp_sweep_dir", None)
    if made:
        import shutil

        shutil.rmtree(made, ignore_errors=True)


@pytest.hookimpl(wrapper=True)  # before every plain implementation, xdist's (which reads the group marks) too:
def pytest_collection_modifyitems(config, items):  # a tryfirst one ran after it under pytest 9.2
    for item in items:
        if item.get_closest_marker("xdist_group") is None:  # else a module that names its group itself
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order
    return (yield)
