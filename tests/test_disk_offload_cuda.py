"""The disk tier of ZeRO-3 offload on one CUDA device (issue 31, item 6). Skipped without a GPU.

On CUDA FSDP2 computes on the device while the disk tier's shards, gradients and optimizer state stay in
files on the host: the case the CPU tests cannot reach (there the compute device is the host). One multirun
of gpt_small, 8 AdamW steps, one GPU: ``zero3_offload`` with host offload and with the disk tier. The disk
tier must train (it stopped at setup with "attempting to assign a gradient with device type 'cuda' to a
tensor with device type 'cpu'"), give host offload's losses within rtol 1e-4 (the same computation on the
same values; the margin only covers CUDA kernels that are not bitwise deterministic from run to run: a
shard or gradient staged wrongly moves the losses by orders of magnitude more), keep its gradients on the
host, and route FSDP2's copies through page-locked buffers (``PinnedStaging``), seen by a callback in
the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from tests.helpers import QUICK, run_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 8


class StagingProbe(L.Callback):
    """At the end of training, ``<run dir>/staging.json``: what the disk tier's staging did and where the
    parameters and gradients are (the strategy closes the tier at teardown, after this)."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tier = getattr(trainer.strategy, "disk_tier", None)
        staging = tier.staging if tier is not None else None
        params = list(pl_module.parameters())
        info = {"tier": tier is not None, "staging": staging is not None,
                "param_devices": sorted({p.device.type for p in params}),
                "grad_devices": sorted({p.grad.device.type for p in params if p.grad is not None})}
        if staging is not None:
            info.update(device_type=staging.device_type, pinned=[b.is_pinned() for b in staging.buffers()],
                        h2d=staging.h2d_copies, d2h=staging.d2h_copies)
        Path(trainer.default_root_dir, "staging.json").write_text(json.dumps(info))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_disk_tier_trains_on_cuda_with_host_offloads_losses(tmp_path):
    out = tmp_path / "sweep"
    run_cli(["-m", *QUICK, f"trainer.max_steps={STEPS}", "model=gpt_small", "strategy=zero3_offload",
             "trainer.accelerator=gpu", "trainer.devices=1", f"strategy.offload_dir=null,{tmp_path / 'offload'}",
             "+callbacks.probe._target_=tests.test_disk_offload_cuda.StagingProbe", f"hydra.sweep.dir={out}"],
            out, timeout=800)
    runs = {}
    for job in sorted(p for p in out.iterdir() if p.is_dir() and p.name.isdigit()):
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        runs["host" if "offload_dir=null" in overrides else "disk"] = (
            json.loads((job / "summary.json").read_text()), json.loads((job / "staging.json").read_text()))
    (host, host_probe), (disk, probe) = runs["host"], runs["disk"]
    assert len(disk["losses"]) == len(host["losses"]) == STEPS
    np.testing.assert_allclose(disk["losses"], host["losses"], rtol=1e-4, atol=0)
    # host offload: FSDP2's own (pinned) shards, no tier
    assert not host_probe["tier"] and host_probe["param_devices"] == ["cpu"], host_probe
    # the disk tier: shards and gradients on the host (the files), FSDP2's copies staged through pinned memory
    assert probe["tier"] and probe["staging"] and probe["device_type"] == "cuda", probe
    assert probe["param_devices"] == ["cpu"] and probe["grad_devices"] == ["cpu"], probe
    assert len(probe["pinned"]) == 3 and all(probe["pinned"]), probe  # two host-to-device slots, one for gradients
    assert probe["h2d"] > 0 and probe["d2h"] > 0, probe
    assert not any((tmp_path / "offload").iterdir())  # the files were unlinked when mapped
