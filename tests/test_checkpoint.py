"""Sharded checkpoints that move between strategies and world sizes, and loop-state resume.

End-to-end: the shared 4-rank runs (``tests/sweeps.py``) save a checkpoint every 3 steps. Runs
resumed from zero3's step-6 checkpoint under ddp and zero2 on 2 ranks and under single, and from
zero2's step-9 checkpoint under fsdp and zero1 on 2 ranks, must continue with the losses of the
uninterrupted single-device run (steps 7..12 and 10..12; loss-parity tolerance, rtol 1e-5 and
atol 1e-6). That needs the model and optimizer states (AdamW m, v, step) *and* the data position:
the resumed epoch must skip the samples already seen (without that skip the losses differ by ~0.3).

Readable by Lightning's tools: a zero3 checkpoint written by 2 ranks holds only plain Python and
tensors (``torch.load(weights_only=True)``), and Lightning's ``consolidate_checkpoint`` turns it into
one file with the same tensors. Damaged checkpoints (empty, truncated, missing, garbled files) stop
with one line naming the file.
"""

from __future__ import annotations

import json

from pathlib import Path

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.data import DataParallelSampler
from lightning_par.models import GPTModule
from lightning_par.strategies.checkpoint.dcp import CheckpointError, ResumableLoader, canonical_fqn, check_checkpoint, plain
from tests import launch
from tests.helpers import QUICK, ROOT, run_cli
from tests.sweeps import FOUR_RANKS, by_strategy, single_refs, sweep, sweep_dir

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
    assert "model.net.blocks.0.attn.wq.weight" in keys  # parameter FQNs, no wrapper prefixes
    assert keys["model.net.blocks.0.attn.wq.weight"].size == torch.Size([64, 64])  # global shape
    meta = torch.load(path / "meta.pt", weights_only=True)
    assert meta["global_step"] == 6
    assert meta["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"samples_consumed": 6 * 8}]
    # every strategy writes the same canonical optimizer layout: full-shape m and v per parameter FQN
    module = GPTModule(preset="gpt_tiny")
    with torch.device("meta"):
        module.configure_model()  # the architecture is built here, not in __init__
    names = [n for n, _ in module.named_parameters()]
    assert names
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        md = dcp.FileSystemReader(checkpoints_of(strategy) / "step000006.ckpt").read_metadata().state_dict_metadata
        state = {k for k in md if k.startswith("optimizer_0.state.")}
        assert state == {f"optimizer_0.state.{n}.{k}" for n in names for k in ("step", "exp_avg", "exp_avg_sq")}, strategy
        assert md[f"optimizer_0.state.{names[0]}.exp_avg"].size == md[f"model.{names[0]}"].size, strategy


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


# ------------------------------------------------------- plain contents, Lightning's tools, damage
def test_plain_turns_omegaconf_and_paths_into_python():
    hp = OmegaConf.create({"betas": [0.9, 0.95], "net": {"n_layer": 2, "dims": (1, 2)}})
    state = {"hparams": hp, "path": Path("/x/y"), "t": torch.ones(2), "size": torch.Size([2, 3]),
             "groups": [{"betas": hp.betas, "lr": 0.1}], "pair": (hp.net, 1)}
    out = plain(state)
    assert out["hparams"] == {"betas": [0.9, 0.95], "net": {"n_layer": 2, "dims": [1, 2]}}
    assert type(out["hparams"]) is dict and type(out["groups"][0]["betas"]) is list
    assert out["path"] == "/x/y" and out["t"] is state["t"] and out["size"] == torch.Size([2, 3])
    buf = Path(os.environ.get("TMPDIR", "/tmp")) / f"lp_plain_{os.getpid()}.pt"
    try:
        torch.save(out, buf)
        back = torch.load(buf, weights_only=True)
        torch.save(state, buf)
        with pytest.raises(Exception, match="Unsupported global"):  # what the fix is for: OmegaConf is not safe
            torch.load(buf, weights_only=True)
    finally:
        buf.unlink(missing_ok=True)
    assert back["groups"][0]["betas"] == [0.9, 0.95]


_PLAIN = (dict, list, tuple, str, int, float, bool, type(None), torch.Tensor)


def _non_plain(obj, where: str = "") -> list[str]:
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _non_plain(v, f"{where}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in _non_plain(v, f"{where}[{i}]")]
    return [] if isinstance(obj, _PLAIN) else [f"{where}: {type(obj).__name__}"]


@pytest.fixture(scope="module")
def zero3_x2(tmp_path_factory) -> Path:
    """A zero3 checkpoint written by 2 ranks (step 6)."""
    run_dir = tmp_path_factory.mktemp("zero3x2")
    run_cli([*QUICK, "strategy=zero3", "trainer.devices=2", "trainer.max_steps=6", "callbacks=checkpoint",
             "callbacks.checkpoint.every_n_train_steps=6"], run_dir, timeout=300)
    path = run_dir / "checkpoints" / "step000006.ckpt"
    assert sorted(p.name for p in path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    return path


@pytest.mark.slow
def test_checkpoint_holds_only_plain_python_and_tensors(zero3_x2, tmp_path):
    meta = torch.load(zero3_x2 / "meta.pt", weights_only=True)
    assert meta["hyper_parameters"]["betas"] == [0.9, 0.95]  # was an OmegaConf ListConfig
    assert _non_plain(meta) == []
    # the DCP payload (tensors and the pickled non-tensor values in the shard files), re-saved as one file
    dcp_to_torch_save(zero3_x2, tmp_path / "full.pt")
    payload = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(payload) == {"model", "optimizer_0"}
    assert _non_plain(payload) == []


def _consolidate(ckpt: Path, out: Path) -> subprocess.CompletedProcess:
    return launch.run([sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(ckpt),
                           "--output_file", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_lightning_consolidate_checkpoint_reads_it(zero3_x2, tmp_path):
    out = tmp_path / "zero3.ckpt"
    proc = _consolidate(zero3_x2, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    full = torch.load(out, weights_only=True)
    assert full["global_step"] == 6 and len(full["optimizer_states"]) == 1
    # the sharded tensors, read by DCP into full-size tensors of a fresh model
    module = GPTModule(preset="gpt_tiny", seq_len=64)
    module.configure_model()  # builds the architecture (on the CPU here)
    assert module.state_dict()
    template = {"model": {k: torch.empty_like(v) for k, v in module.state_dict().items()}}
    dcp.load(template, checkpoint_id=zero3_x2, no_dist=True)
    assert set(full["state_dict"]) == set(template["model"])
    for name, tensor in template["model"].items():
        assert torch.equal(full["state_dict"][name], tensor), name
    # and Lightning loads it as an ordinary checkpoint file
    loaded = GPTModule.load_from_checkpoint(out, map_location="cpu")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, template["model"][name]), name


_DAMAGE = {
    "empty shard": ("__0_0.distcp", 0),
    "truncated shard": ("__1_0.distcp", 0.5),
    "missing shard": ("__1_0.distcp", None),
    "empty .metadata": (".metadata", 0),
    "truncated .metadata": (".metadata", 0.5),
    "missing .metadata": (".metadata", None),
    "empty meta.pt": ("meta.pt", 0),
    "truncated meta.pt": ("meta.pt", 0.5),
    "missing meta.pt": ("meta.pt", None),
}


def _damaged_copy(ckpt: Path, dest: Path, name: str, keep: float | None) -> Path:
    shutil.copytree(ckpt, dest)
    target = dest / name
    if keep is None:
        target.unlink()
    else:
        with open(target, "r+b") as f:
            f.truncate(int(target.stat().st_size * keep))
    return target


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(_DAMAGE))
def test_damaged_checkpoint_is_one_line_naming_the_file(zero3_x2, tmp_path, case):
    check_checkpoint(zero3_x2)  # the intact one passes
    name, keep = _DAMAGE[case]
    target = _damaged_copy(zero3_x2, tmp_path / "ckpt", name, keep)
    with pytest.raises(CheckpointError) as err:
        check_checkpoint(target.parent)
    message = str(err.value)
    assert "\n" not in message and len(message) < len(str(target)) + 150, message
    named = str(target) if name != ".metadata" or keep is not None else str(target.parent)  # a missing .metadata: the dir
    assert named in message, message


def _garble(target: Path, n: int = 5000, at: int = 64) -> None:
    """``n`` random bytes written in place (the file's size unchanged): what DCP alone cannot see."""
    size = target.stat().st_size
    with open(target, "r+b") as f:
        f.seek(min(at, max(0, size - n)))
        f.write(os.urandom(min(n, size)))
    assert target.stat().st_size == size


@pytest.mark.slow
@pytest.mark.parametrize("name", ["__0_0.distcp", "__1_0.distcp", "meta.pt"])
def test_garbled_file_is_one_line_naming_it(zero3_x2, tmp_path, name):
    record = json.loads((zero3_x2 / "checksums.json").read_text())
    # every file of the checkpoint is listed: both ranks' shards, .metadata, meta.pt
    assert sorted(record["files"]) == sorted(p.name for p in zero3_x2.iterdir() if p.name != "checksums.json")
    dest = tmp_path / "ckpt"
    shutil.copytree(zero3_x2, dest)
    _garble(dest / name)
    with pytest.raises(CheckpointError) as err:
        check_checkpoint(dest)
    message = str(err.value)
    assert "\n" not in message and f"checkpoint file {dest / name} is damaged" in message, message


@pytest.mark.slow
def test_a_checkpoint_saved_before_checksums_loads_with_a_note(zero3_x2, tmp_path, capfd):
    dest = tmp_path / "old"
    shutil.copytree(zero3_x2, dest)
    (dest / "checksums.json").unlink()
    check_checkpoint(dest)  # passes
    check_checkpoint(dest)  # noted once per process
    err = capfd.readouterr().err
    assert err.count(f"note: checkpoint {dest} has no checksums.json") == 1, err


@pytest.mark.slow
def test_not_a_checkpoint_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        check_checkpoint(tmp_path / "nope")
    (tmp_path / "file.ckpt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="file.ckpt is not a readable Lightning checkpoint"):
        check_checkpoint(tmp_path / "file.ckpt")  # a file: Lightning's single-file format, converted when loaded
    check_checkpoint(None)
    check_checkpoint("last")  # Lightning resolves its own names


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_resume_from_damaged_checkpoints_stops_with_one_line(zero3_x2, tmp_path):
    """Through run.py, before any rank starts: a truncated shard on one process, and 5000 random bytes
    garbled in place (same size: DCP itself loads it without complaint) on 2 ranks, each one line naming
    the file, printed once."""
    truncated = _damaged_copy(zero3_x2, tmp_path / "truncated", "__1_0.distcp", 0.5)
    garbled = tmp_path / "garbled"
    shutil.copytree(zero3_x2, garbled)
    _garble(garbled / "__0_0.distcp")
    args = [*QUICK, "trainer.max_steps=8"]
    for ckpt, extra, named in ((truncated.parent, ["strategy=single"], str(truncated)),
                               (garbled, ["strategy=ddp", "trainer.devices=2"], str(garbled / "__0_0.distcp"))):
        run_dir = tmp_path / f"run_{ckpt.name}"
        proc = run_cli([*args, *extra, f"ckpt_path={ckpt}"], run_dir, timeout=180, check=False)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        lines = _error_lines(proc)
        assert len(lines) == 1 and named in lines[0], proc.stderr[-3000:]
        assert "Initializing distributed" not in proc.stdout + proc.stderr  # before any process started
        assert not (run_dir / "summary.json").exists()
