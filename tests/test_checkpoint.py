"""Sharded checkpoints that move between strategies and world sizes, and loop-state resume.

End-to-end: the 4-rank runs of ``test_e2e_sharded.py`` save a checkpoint every 3 steps. Runs
resumed from zero3's step-6 checkpoint under ddp and zero2 on 2 ranks and under single, and from
zero2's step-9 checkpoint under fsdp and zero1 on 2 ranks, must continue with the losses of the
uninterrupted single-device run (steps 7..12 and 10..12; loss-parity tolerance, rtol 1e-5 and
atol 1e-6). That needs the model and optimizer states (AdamW m, v, step) *and* the data position:
the resumed epoch must skip the samples already seen (without that skip the losses differ by ~0.3).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.data import DataParallelSampler
from lightning_par.models import GPTModule
from lightning_par.strategies.checkpoint import ResumableLoader, canonical_fqn
from tests.test_e2e_sharded import FOUR_RANKS, by_strategy, single_refs, sweep, sweep_dir

pytestmark = pytest.mark.timeout(900)

STEPS, EVERY = 12, 3  # QUICK runs 12 steps; FOUR_RANKS saves every 3


# ---------------------------------------------------------------- loop state (fast, in-process)
def _loader(dp_rank: int, dp_size: int, global_batch: int = 8, n: int = 100) -> DataLoader:
    data = TensorDataset(torch.arange(n))
    sampler = DataParallelSampler(n, micro_batch=global_batch // dp_size, dp_rank=dp_rank, dp_size=dp_size, seed=3)
    return DataLoader(data, batch_size=global_batch // dp_size, sampler=sampler, drop_last=True)


def _global_batches(dp_size: int, skip_state: dict | None = None, epoch: int = 0) -> list[list[int]]:
    """Per step, the union of the ranks' batches (sorted)."""
    per_rank = []
    for r in range(dp_size):
        loader = ResumableLoader(_loader(r, dp_size), dp_size)
        loader.sampler.set_epoch(epoch)
        if skip_state is not None:
            loader.load_state_dict(skip_state)
        per_rank.append([b[0].tolist() for b in loader])
    return [sorted(sum(step, [])) for step in zip(*per_rank)]


def test_resumable_loader_continues_the_order_across_world_sizes():
    full = _global_batches(1)
    assert len(full) == 12
    # 5 steps consumed on 4 ranks -> state saved -> resumed on 2 ranks: steps 6.. of the same order
    saver = ResumableLoader(_loader(0, 4), 4)
    it = iter(saver)
    for _ in range(5):
        next(it)
    state = saver.state_dict()
    assert state == {"samples_consumed": 5 * 8}
    assert _global_batches(2, state) == full[5:]
    assert _global_batches(1, state, epoch=1)[0] == _global_batches(1, epoch=1)[5]  # the epoch's own order
    # a finished epoch: the next one starts from its beginning
    assert _global_batches(2, {"samples_consumed": 12 * 8}) == full
    with pytest.raises(ValueError, match="not a multiple of the global micro-batch 8"):
        ResumableLoader(_loader(0, 2), 2).load_state_dict({"samples_consumed": 12})


def test_canonical_fqn_drops_wrapper_prefixes():
    assert canonical_fqn("net.blocks.0._checkpoint_wrapped_module.attn.wq.weight") == "net.blocks.0.attn.wq.weight"
    assert canonical_fqn("net._orig_mod.head.lm_head.weight") == "net.head.lm_head.weight"


# ------------------------------------------------------------- across strategies (end to end)
def checkpoints_of(strategy: str) -> Path:
    """The checkpoint directory of ``strategy``'s 4-rank run (saved at steps 3, 6, 9, 12)."""
    job = FOUR_RANKS[0].split("=")[1].split(",").index(strategy)
    out = sweep_dir(*FOUR_RANKS) / str(job) / "checkpoints"
    assert sorted(p.name for p in out.iterdir()) == [f"step{s:06d}.ckpt" for s in range(EVERY, STEPS + 1, EVERY)]
    return out


def _assert_continues(resumed: dict, ref: dict, from_step: int) -> None:
    got = np.asarray(resumed["losses"])[-(STEPS - from_step):]
    np.testing.assert_allclose(got, np.asarray(ref["losses"])[from_step:], rtol=1e-5, atol=1e-6,
                               err_msg=f"{resumed['strategy']} x{resumed['world_size']} resumed at {from_step}")


@pytest.mark.slow
def test_checkpoint_is_sharded_and_canonical():
    path = checkpoints_of("zero3") / "step000006.ckpt"
    assert sorted(p.name for p in path.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert "state_dict.net.blocks.0.attn.wq.weight" in keys  # parameter FQNs, no wrapper prefixes
    assert keys["state_dict.net.blocks.0.attn.wq.weight"].size == torch.Size([64, 64])  # global shape
    meta = torch.load(path / "meta.pt", weights_only=False)
    assert meta["global_step"] == 6
    assert meta["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"samples_consumed": 6 * 8}]
    # every strategy writes the same canonical optimizer layout: full-shape m and v per parameter FQN
    names = [n for n, _ in GPTModule(preset="gpt_tiny").named_parameters()]
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        md = dcp.FileSystemReader(checkpoints_of(strategy) / "step000006.ckpt").read_metadata().state_dict_metadata
        state = {k for k in md if k.startswith("optimizer_0.state.")}
        assert state == {f"optimizer_0.state.{n}.{k}" for n in names for k in ("step", "exp_avg", "exp_avg_sq")}, strategy
        assert md[f"optimizer_0.state.{names[0]}.exp_avg"].size == md[f"state_dict.{names[0]}"].size, strategy


@pytest.mark.slow
def test_zero3_x4_resumes_under_ddp_zero2_x2_and_single():
    ckpt = checkpoints_of("zero3") / "step000006.ckpt"
    runs = by_strategy(sweep("strategy=ddp,zero2,single", "trainer.devices=2", f"ckpt_path={ckpt}"))
    assert {k: v["world_size"] for k, v in runs.items()} == {"ddp": 2, "zero2": 2, "single": 1}
    for s in runs.values():
        _assert_continues(s, single_refs()[0], 6)


@pytest.mark.slow
def test_zero2_x4_resumes_under_fsdp_and_zero1_x2():
    ckpt = checkpoints_of("zero2") / "step000009.ckpt"
    runs = by_strategy(sweep("strategy=fsdp,zero1", "trainer.devices=2", f"ckpt_path={ckpt}"))
    assert {k: v["world_size"] for k, v in runs.items()} == {"fsdp": 2, "zero1": 2}
    for s in runs.values():
        _assert_continues(s, single_refs()[0], 9)
