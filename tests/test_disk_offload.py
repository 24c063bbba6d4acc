"""The disk tier of ZeRO-3 offload (``zero3_offload strategy.offload_dir=DIR``, parallel/sharding/disk_offload.py).

One shared multirun (gpt_tiny, 12 AdamW steps, a checkpoint at step 6): zero3_offload with and without
the disk tier at 1 and 2 ranks. The disk tier must give CPU offload's losses (rtol 1e-6; measured:
equal to the bit, as the same single-tensor AdamW runs on the same values, chunk by chunk), resume from
its own checkpoint with the uninterrupted run's losses, and a full disk must stop the run with one line
and error.json, leaving the checkpoint it resumed from as it was and no file behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import launch
from tests.helpers import QUICK, ROOT, run_cli

STEPS = 12


@pytest.fixture(scope="module")
def app_runs(tmp_path_factory) -> tuple[Path, dict]:
    """(root, the runs): the multirun of four jobs (``sweep``), the two resumes from its step-6 checkpoints
    (``resumed``, ``from_cpu``) and the accumulating multirun (``accumulating``), one after another in one
    process (``tests/serial.py``), each as its command runs it."""
    from tests import serial

    root = tmp_path_factory.mktemp("disk")
    offload, out = root / "offload", root / "sweep"
    disk_ckpt, cpu_ckpt = (out / str(job) / "checkpoints" / "step000006.ckpt" for job in (3, 0))  # (2, disk), (1, cpu)
    runs = serial.app_runs({
        "sweep": ["-m", *QUICK, "strategy=zero3_offload", "trainer.devices=1,2", f"strategy.offload_dir=null,{offload}",
                  "callbacks=checkpoint", "callbacks.checkpoint.every_n_train_steps=6", "strategy.offload_chunk_mb=0.1",
                  f"hydra.sweep.dir={out}"],
        "resumed": [*QUICK, "strategy=zero3_offload", "trainer.devices=2", f"strategy.offload_dir={offload}",
                    "strategy.offload_chunk_mb=0.1", f"ckpt_path={disk_ckpt}"],
        "from_cpu": [*QUICK, "strategy=zero3_offload", f"strategy.offload_dir={offload}", f"ckpt_path={cpu_ckpt}"],
        "accumulating": ["-m", *QUICK, "trainer.max_steps=8", "strategy=zero3_offload", "trainer.devices=2",
                         "trainer.accumulate_grad_batches=2", "strategy.activation_checkpointing=true",
                         f"strategy.offload_dir=null,{root / 'accumulating_offload'}", "scheduler=warmup_cosine",
                         "scheduler.warmup_steps=3", "trainer.gradient_clip_val=0.5",
                         f"hydra.sweep.dir={root / 'accumulating' / 'sweep'}"],
    }, root, timeout=1500)
    return root, runs


@pytest.fixture(scope="module")
def sweep_runs(app_runs) -> tuple[Path, dict[tuple[int, bool], dict], Path]:
    """(sweep dir, {(ranks, disk): summary}, offload dir): one multirun of the four jobs."""
    root, done = app_runs
    done["sweep"].job.check()
    offload = root / "offload"
    out = root / "sweep"
    runs = {}
    for job in sorted(p for p in out.iterdir() if p.is_dir() and p.name.isdigit()):
        summary = json.loads((job / "summary.json").read_text())
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        runs[(summary["world_size"], "offload_dir=null" not in overrides)] = {**summary, "dir": str(job)}
    return out, runs, offload


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("ranks", [1, 2])
def test_disk_tier_matches_cpu_offload(sweep_runs, ranks):
    _, runs, offload = sweep_runs
    disk, cpu = runs[(ranks, True)], runs[(ranks, False)]
    assert len(disk["losses"]) == len(cpu["losses"]) == STEPS
    np.testing.assert_allclose(disk["losses"], cpu["losses"], rtol=1e-6, atol=0)
    for mem in disk["memory"]:  # the states are counted where they live: the files (offloaded bytes)
        assert mem["offloaded"] >= mem["params"] + mem["grads"] + mem["optimizer_state"] - 4096 * 3
        assert mem["optimizer_state"] >= 2 * mem["params"] - 4096  # AdamW's m and v, in their files
    assert offload.is_dir() and not any(offload.iterdir())  # the files were unlinked when mapped


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_disk_tier_resumes_with_the_uninterrupted_losses(sweep_runs, app_runs):
    _, runs, offload = sweep_runs
    _, done = app_runs
    ref = runs[(2, True)]
    ckpt = Path(ref["dir"]) / "checkpoints" / "step000006.ckpt"
    assert (ckpt / ".metadata").is_file()
    assert f"ckpt_path={ckpt}" in done["resumed"].job.args and f"strategy.offload_dir={offload}" in done["resumed"].job.args
    resumed = done["resumed"].summary()
    got = np.asarray(resumed["losses"])[-(STEPS - 6):]
    np.testing.assert_allclose(got, np.asarray(ref["losses"])[6:], rtol=1e-6, atol=0)
    # and a checkpoint of the CPU offload run resumes under the disk tier at one rank
    cpu_ckpt = Path(runs[(1, False)]["dir"]) / "checkpoints" / "step000006.ckpt"
    assert f"ckpt_path={cpu_ckpt}" in done["from_cpu"].job.args
    got = np.asarray(done["from_cpu"].summary()["losses"])[-(STEPS - 6):]
    np.testing.assert_allclose(got, np.asarray(runs[(1, False)]["losses"])[6:], rtol=1e-6, atol=0)


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_full_disk_is_one_line_and_leaves_the_checkpoint_whole(sweep_runs, tmp_path):
    """A file size limit in the ranks (RLIMIT_FSIZE, inherited by the ranks the app starts) makes the
    disk tier's preallocation fail as a full disk would (EFBIG; ENOSPC is the same path): one line,
    error.json, a non-zero exit; the checkpoint the run was resuming from is unchanged and still loads."""
    from lightning_par.strategies.checkpoint.dcp import check_checkpoint

    _, runs, _ = sweep_runs
    ckpt = Path(runs[(2, True)]["dir"]) / "checkpoints" / "step000006.ckpt"
    before = _digest(ckpt)
    offload = tmp_path / "small"
    run_dir = tmp_path / "full"
    limit = 128 * 2**10  # bytes per file: below gpt_tiny's parameter file (about 290 KiB per rank at 2 ranks)

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    cmd = [sys.executable, str(ROOT / "run.py"), *QUICK, "strategy=zero3_offload", "trainer.devices=2",
           f"strategy.offload_dir={offload}", f"ckpt_path={ckpt}", f"hydra.run.dir={run_dir}"]
    proc = launch.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=small_files)
    assert proc.returncode != 0, proc.stderr[-3000:]
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]
    assert lines and all("disk tier: no room for" in ln and str(offload) in ln for ln in lines), proc.stderr[-3000:]
    error = json.loads((run_dir / "error.json").read_text())
    assert "disk tier: no room for" in error["error"] and "\n" not in error["error"]
    log = (run_dir / "run.log").read_text()  # and its traceback in run.log (not on the console)
    assert "failed: DiskFullError: disk tier: no room for" in log and "Traceback (most recent call last)" in log
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert not (run_dir / "summary.json").exists()
    assert _digest(ckpt) == before  # the state on disk: untouched
    check_checkpoint(ckpt)
    assert not any(offload.iterdir())  # nothing half-written left at the offload directory


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_offload_dir_checked_before_launch(tmp_path):
    """Not a directory, and too little room for the model's states: one line before any rank starts."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    proc = run_cli([*QUICK, "strategy=zero3_offload", f"strategy.offload_dir={a_file}/sub"], tmp_path / "r1",
                   timeout=120, check=False)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: strategy.offload_dir={a_file}/sub: cannot create the directory")
    # gpt_7b's states at 16 bytes per parameter need more than this disk has free (else: skip)
    need = 16 * 6.6e9
    if shutil.disk_usage(tmp_path).free > need:
        pytest.skip("the disk has room for gpt_7b's states")
    proc = run_cli(["strategy=zero3_offload", "model=gpt_7b", f"strategy.offload_dir={tmp_path / 'off'}",
                    "check_memory=false", "trainer.max_steps=1"], tmp_path / "r2", timeout=180, check=False)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "the disk tier needs" in lines[0] and "GiB are free" in lines[0], lines


def test_full_offload_dir_reports_real_sizes(tmp_path, monkeypatch):
    """A nearly full file system at the offload directory (``shutil.disk_usage`` says so): the line names
    the bytes the ranks' files need and the bytes free in units that show them (a small model's files and
    a full disk are KiB or MiB, which whole GiB once showed as "needs 0.00 GiB there, 0.00 GiB are free"),
    before launch through the strategy's own check too."""
    from torch import nn

    from lightning_par.parallel.sharding import disk_offload
    from lightning_par.strategies.zero import Zero3OffloadStrategy

    free = {"bytes": 3 * 2**20}
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(disk_offload.shutil, "disk_usage",
                        lambda path: usage._replace(free=free["bytes"], used=usage.total - free["bytes"]))
    with pytest.raises(ValueError) as e:
        disk_offload.check_offload_dir(tmp_path / "off", 5 * 2**20 + 2**19)
    line = str(e.value)
    assert line == (f"strategy.offload_dir={tmp_path / 'off'}: the disk tier needs 5.5 MiB there, 3.0 MiB are free; "
                    "free space there or set strategy.offload_dir to a directory with more room"), line
    assert disk_offload.check_offload_dir(tmp_path / "off", 2 * 2**20) == tmp_path / "off"  # room: accepted
    # sizes that round alike are told apart in bytes
    free["bytes"] = 3_000_000
    with pytest.raises(ValueError, match=r"needs 2\.9 MiB \(3000001 bytes\) there, 2\.9 MiB \(3000000 bytes\) "
                                         r"are free"):
        disk_offload.check_offload_dir(tmp_path / "off", 3_000_001)
    # a full disk under the strategy's check before launch: 2 ranks of a 100,100-parameter model, each 16 bytes per
    # parameter of its half (fp32 shard, gradient, AdamW's m and v): 800,800 bytes per rank
    free["bytes"] = 0
    strategy = Zero3OffloadStrategy(offload_dir=str(tmp_path / "full"))
    with pytest.raises(ValueError) as e:
        strategy.validate_setup(2, nn.Linear(1000, 100))
    line = str(e.value)
    assert "\n" not in line and "0.00 GiB" not in line, line
    assert "the disk tier needs 1.5 MiB there (2 ranks x 782.0 KiB of fp32 parameter and gradient shards and AdamW " \
           "state), 0 B are free" in line, line


def test_file_tier_releases_pages_and_keeps_data(tmp_path):
    """A view written, released (MADV_DONTNEED) and read again holds what was written."""
    from lightning_par.parallel.sharding.disk_offload import DiskFullError, FileArena

    arena = FileArena(tmp_path, "a.bin", 3 * 2**20)
    assert not any(tmp_path.iterdir())  # unlinked at once
    t = torch.empty(2**18)
    arena.point(t, arena.alloc(t.numel() * 4))
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    arena.release()
    assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32))
    arena.close()

    def tiny() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**16, resource.RLIM_INFINITY))

    code = ("import sys; from pathlib import Path; from lightning_par.parallel.sharding.disk_offload import FileArena\n"
            "try:\n    FileArena(Path(sys.argv[1]), 'b.bin', 2**20)\nexcept OSError as e:\n    print(type(e).__name__, e)")
    out = launch.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         preexec_fn=tiny, timeout=60)
    assert out.stdout.startswith(f"{DiskFullError.__name__} ") and "disk tier: no room for 1.0 MiB" in out.stdout, out


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


def _peak_rss_file_during(fn) -> tuple[object, int]:  # noqa: ANN001
    """``fn()``'s result and the largest growth of this process's file-backed resident memory while it ran
    (sampled by a thread every 0.2 ms)."""
    import threading

    base, peak, done = _rss_file(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_file() - base)
            done.wait(0.0002)

    t = threading.Thread(target=sample)
    t.start()
    try:
        out = fn()
    finally:
        done.set()
        t.join()
    return out, max(peak[0], _rss_file() - base)


def test_clipping_reads_the_gradient_files_a_chunk_at_a_time(tmp_path):
    """``trainer.gradient_clip_val`` under the disk tier: the strategy routes Lightning's clipping to the
    paged optimizer, which reads and scales the gradient files a chunk (1 MiB here) at a time. The same
    clipping as torch's (norm and scaled gradients, rtol 1e-6), while the file-backed resident memory
    grows by at most two chunks; torch's own clip_grad_norm_ on the same views makes all 16 MiB of
    gradients resident (so the measure can tell them apart)."""
    from torch import nn

    from lightning_par.parallel.sharding.disk_offload import FileTier, PagedOptimizer

    torch.manual_seed(0)
    tier = FileTier(tmp_path, chunk_mb=1.0)
    params = [nn.Parameter(torch.randn(256, 1024)) for _ in range(16)]  # 1 MiB each
    tier.params = list(params)
    tier.home_gradients()
    opt = PagedOptimizer(torch.optim.SGD(params, lr=0.1), tier)
    values = [torch.randn(256, 1024) for _ in params]
    for warm_up in (True, False):  # the first calls also fault in library code, which RssFile counts too
        for p, v in zip(params, values):
            p.grad.copy_(v)
            tier.dirty.add(p)
        tier.release()
        if warm_up:
            opt.clip_grad_norm_(1.0)
            opt.clip_grad_value_(1e-4)
    want_norm = torch.linalg.vector_norm(torch.cat([v.double().flatten() for v in values])).float()
    total, grown = _peak_rss_file_during(lambda: opt.clip_grad_norm_(1.0))
    torch.testing.assert_close(total, want_norm, rtol=1e-6, atol=0)
    values = [v * (1.0 / (want_norm + 1e-6)) for v in values]  # torch's coefficient: max_norm / (norm + 1e-6)
    for p, v in zip(params, values):
        torch.testing.assert_close(p.grad, v, rtol=1e-6, atol=1e-9)
    assert grown <= 2 * 2**20 + 2**18, grown / 2**20
    # by value, the same way
    clipped = [v.clamp(-1e-4, 1e-4) for v in values]
    _, grown_value = _peak_rss_file_during(lambda: opt.clip_grad_value_(1e-4))
    for p, v in zip(params, clipped):
        torch.testing.assert_close(p.grad, v, rtol=0, atol=0)
    assert (clipped[0].abs() == 1e-4).float().mean() > 0.5  # the value clip bites
    assert grown_value <= 2 * 2**20 + 2**18, grown_value / 2**20
    tier.release()
    _, grown_torch = _peak_rss_file_during(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0))
    print(f"  file-backed RSS grew by: paged norm clip {grown / 2**20:.2f} MiB, by value {grown_value / 2**20:.2f} "
          f"MiB, torch's clip_grad_norm_ {grown_torch / 2**20:.2f} MiB (16 MiB of gradients, 1 MiB chunks)")
    assert grown_torch >= 15 * 2**20, grown_torch / 2**20
    opt.close()
    tier.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_disk_tier_with_accumulation_checkpointing_clipping_and_a_schedule(app_runs):
    """2 ranks x 2 accumulated micro-batches (FSDP adds the second into the gradient files), activation
    checkpointing (forward hooks fire again in recomputation), clipping (the paged optimizer's, chunk by
    chunk, the two ranks' norms summed) and a warm-up schedule (its LR reaches the chunked step): CPU
    offload's losses."""
    root, done = app_runs
    done["accumulating"].job.check()
    out = root / "accumulating" / "sweep"
    cpu, disk = (json.loads((out / str(i) / "summary.json").read_text()) for i in (0, 1))
    assert len(disk["losses"]) == 8
    np.testing.assert_allclose(disk["losses"], cpu["losses"], rtol=1e-6, atol=0)


def _train_sharded(tmp: Path, staging=None) -> tuple[list[torch.Tensor], list[float], object]:  # noqa: ANN001
    """3 AdamW steps of a 3-unit MLP under FSDP2 with CPU offload and the disk tier at ``tmp``, at one rank
    of the process group this process holds: (parameters after, losses, the tier's staging)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_par.parallel.sharding.disk_offload import FileTier, PagedOptimizer
    from lightning_par.parallel.sharding.fsdp import apply_fsdp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    apply_fsdp(model, mesh=init_device_mesh("cpu", (1,)), units=["0", "2"], cpu_offload=True, pin_memory=False)
    tmp.mkdir()
    tier = FileTier(tmp, chunk_mb=0.001)
    tier.home_parameters(model, copy=True)
    tier.attach(model, staging=staging)  # as parallelize does, then the strategy's setup_optimizers
    tier.home_gradients()
    opt = PagedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), tier)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = [p.full_tensor().clone() for p in model.parameters()]
    for p in model.parameters():  # the gradients are still the file views (DTensors around host tensors)
        assert tier.arenas["grads"].holds(p.grad._local_tensor) and p.grad.device == p.device
    used = tier.staging
    opt.close()
    tier.close()
    return params, losses, used


def test_staging_routes_fsdps_copies_and_changes_nothing(tmp_path):
    """On CUDA the tier routes FSDP2's copies of the shards to the device and of the reduced gradients
    back through page-locked buffers (``PinnedStaging``; ``tests/test_disk_offload_cuda.py`` checks it
    there). On CPU it stages nothing by itself; given unpinned buffers of CPU "device" copies, at one
    rank of a gloo group in this process, every shard FSDP2 gathers and every gradient it reduces pass
    through them (counted), and 3 AdamW steps end with the unstaged tier's losses and parameters, bit
    for bit. The slots are smaller than two units' shards, so they are refilled within a step."""
    import torch.distributed as dist

    from lightning_par.parallel.sharding.disk_offload import PinnedStaging

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        ref_params, ref_losses, none = _train_sharded(tmp_path / "plain")
        assert none is None  # CPU compute: nothing staged
        staging = PinnedStaging(32 * 32 * 4, device_type="cpu", pin=False)
        params, losses, used = _train_sharded(tmp_path / "staged", staging)
    finally:
        dist.destroy_process_group()
    assert used is staging
    # 3 steps of 6 parameters, each gathered in forward and again in backward, and its gradient reduced once
    assert staging.h2d_copies == 3 * 12 and staging.d2h_copies == 3 * 6, (staging.h2d_copies, staging.d2h_copies)
    assert losses == ref_losses
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)
    assert not any(b.is_pinned() for b in staging.buffers())  # CPU: no page-locking (and no CUDA to ask)


def test_gradient_views_stay_on_the_host_on_a_cuda_mesh(tmp_path, monkeypatch):
    """Issue 31 item 6: under FSDP2's CPU offload a shard is a DTensor whose local tensor is on the host
    while its mesh is the compute device's. The tier made its gradient views with ``DTensor.from_local``,
    which moves the local tensor to the mesh's device type: on CUDA each view became a new CUDA tensor,
    and assigning it as the host shard's ``.grad`` raised "attempting to assign a gradient with device
    type 'cuda' to a tensor with device type 'cpu'". Here the mesh says "cuda" (any copy to CUDA fails in
    this build): the gradients are DTensors of the parameters' spec around the file views, and the paged
    optimizer clips (its norm's all-reduce skipped at one rank, never a host tensor handed to NCCL) and
    steps over them."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_par.parallel.sharding.disk_offload import FileTier, PagedOptimizer

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        params = [nn.Parameter(DTensor.from_local(torch.randn(8, 4), mesh, [Shard(0)])) for _ in range(3)]
        monkeypatch.setattr(mesh, "_device_type", "cuda")
        tier = FileTier(tmp_path, chunk_mb=0.0001)
        tier.params = list(params)
        tier.home_gradients()
        for p in params:
            assert isinstance(p.grad, DTensor) and p.grad.device_mesh is mesh and p.grad.placements == p.placements
            assert tier.arenas["grads"].holds(p.grad._local_tensor) and p.grad._local_tensor.device.type == "cpu"
        opt = PagedOptimizer(torch.optim.SGD(params, lr=0.5), tier)
        before = [p._local_tensor.clone() for p in params]
        for p in params:
            p.grad._local_tensor.fill_(1.0)
            tier.dirty.add(p)
        total = opt.clip_grad_norm_(1e9)
        torch.testing.assert_close(total, torch.tensor(float(3 * 32) ** 0.5))
        opt.step()
        for p, b in zip(params, before):
            torch.testing.assert_close(p._local_tensor, b - 0.5)
            assert tier.arenas["grads"].holds(p.grad._local_tensor)
        opt.close()
        tier.close()
    finally:
        dist.destroy_process_group()

