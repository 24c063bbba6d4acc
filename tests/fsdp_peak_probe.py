"""``python -m tests.fsdp_peak_probe N``: FSDPMemTracker's peak of one steady-state training step of the
GPT under this repository's FSDP (``parallel/fsdp.apply_fsdp``: every block a unit, the root too,
prefetch 1), on N simulated ranks: torch's fake process group and fake tensors in one process, so
nothing is allocated and nothing communicates. Prints one JSON line per (layout, shape) with the
tracker's peak and the estimator's (``estimate``, device cpu). Used by tests/test_fsdp_peak.py."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_par.costs.activations import Shape
from lightning_par.costs.estimate import estimate
from lightning_par.models.gpt import GPT, GPTConfig
from lightning_par.parallel.memory.checkpointing import apply_activation_checkpointing
from lightning_par.parallel.sharding.fsdp import apply_fsdp
from lightning_par.parallel.memory.tiling import apply_tiling

#: (micro-batch, sequence, vocabulary, layers, width): the loss dominates, blocks dominate, a large
#: vocabulary, a long sequence
SHAPES = [(4, 256, 8192, 4, 512), (2, 512, 256, 4, 256), (8, 128, 32000, 2, 256), (1, 1024, 4096, 6, 384)]


def tiling_of(layers: int) -> dict[str, int]:
    """Every large layer of the GPT in 4 tiles: each block's linears, the head and the embedding."""
    linears = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.fc", "mlp.proj")
    return {**{f"blocks.{i}.{name}": 4 for i in range(layers) for name in linears}, "head.lm_head": 4,
            "embed.tok": 4}


def tracked_peak(n: int, replicate: int, shape: tuple[int, int, int, int, int], bf16: bool = False,
                 tiled: bool = False) -> int:
    b, t, v, layers, width = shape
    cfg = GPTConfig(vocab_size=v, block_size=t, n_layer=layers, n_head=8, n_embd=width)
    mesh = (init_device_mesh("cpu", (replicate, n // replicate), mesh_dim_names=("dp_replicate", "dp_shard"))
            if replicate > 1 else init_device_mesh("cpu", (n,), mesh_dim_names=("dp_shard",)))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = GPT(cfg)
        units = [f"blocks.{i}" for i in range(layers)]
        if tiled:  # as parallelize does: tiles checkpointed, each an FSDP unit
            tiles = apply_tiling(model, tiling_of(layers))
            apply_activation_checkpointing(model, blocks=tiles)
            units += tiles
        apply_fsdp(model, mesh=mesh, units=units, prefetch=1,
                   param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32 if bf16 else None)
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        x = torch.randint(0, v, (b, t))

        def step() -> None:
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # the optimizer's states exist from here on
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs((x,))
        with tracker:
            step()
    return sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())


def main() -> None:
    n = int(sys.argv[1])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    # (name, strategy, replicate, bf16 gathers: FSDP mixed precision, param_dtype bf16, reduce_dtype fp32;
    # tiled: every large layer in 4 tiles, the advisor's plan for a layer too large to gather)
    layouts = [("zero3", "zero3", 1, False, False), ("fsdp", "fsdp", 1, False, False),
               ("fsdp bf16-gather", "fsdp", 1, True, False)]
    layouts += [("hsdp", "hsdp", 2, False, False)] if n >= 4 else [("fsdp tiled bf16-gather", "fsdp", 1, True, True)]
    for i, shape in enumerate(SHAPES):
        for name, strategy, replicate, bf16, tiled in layouts:
            if tiled and i >= 2:  # a hundred units per step: two shapes (the loss's and the blocks' moments) suffice
                continue
            b, t, v, layers, width = shape
            cfg = GPTConfig(vocab_size=v, block_size=t, n_layer=layers, n_head=8, n_embd=width)
            options: dict = {"replicate": replicate} if replicate > 1 else {}
            if bf16:
                options["gather_bytes"] = 2
            if tiled:
                options["tiling"] = {f"net.{k}": tiles for k, tiles in tiling_of(layers).items()}
            est = estimate(Shape.of(cfg, t), devices=n, strategy=strategy, precision="32-true", optimizer="adamw",
                           micro_batch_size=b, device="cpu", **options)
            print(json.dumps({"ranks": n, "strategy": name, "shape": shape,
                              "tracked": tracked_peak(n, replicate, shape, bf16, tiled), "estimated": est.peak,
                              "moment": est.moment}), flush=True)


if __name__ == "__main__":
    main()
