"""Communication accounting: summary.json's ``comm`` (callbacks/comm.py, counted from the run) equals
its ``comm_predicted`` (``costs/comm.step_comm_bytes`` asked by ``costs/run_prediction.py``;
docs/communication.md) for every strategy, with and without gradient accumulation, and the
collectives benchmark runs at 2 ranks on gloo.

The data-parallel runs are the shared sweeps of ``tests/sweeps.py`` (2 ranks: the 60-step
parity sweep; 4 ranks: ddp ... hsdp; zero3_offload's accumulating sweep), so they cost nothing here
when the suite runs together. One 4-rank sweep of its own (4 heads, so that tp=4 divides them; 3
steps: step 2 is the one counted) covers tensor_parallel, pipeline, fsdp_tp and 3d, with RunGuard
agreeing on its flags every step: its all-reduce must not show in the strategy's figures. fp32
(Ψ·4 bytes per gradient), gpt_tiny, gloo on CPU.

Tolerance: 2% of each predicted (kind, axis) entry (the issue's bound; no padding arises here since
every dimension divides by the world size; measured differences: none, the counts are exact).
"""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from lightning_par.costs.comm import CommShape, step_comm_bytes
from lightning_par.costs.shape import Shape
from lightning_par.models.gpt import PRESETS, GPTConfig
from tests.helpers import ROOT
from tests.sweeps import by_strategy, four_ranks, long_parity, sweep, sweep_dir, together, two_ranks_accumulating

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ALL = ("single", "ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp", "hsdp", "pipeline", "tensor_parallel",
       "fsdp_tp", "3d")
MODEL_PARALLEL_4 = ("strategy=tensor_parallel,pipeline,fsdp_tp,3d", "trainer.devices=4", "+model.n_head=4",
                    "trainer.max_steps=3", "callbacks.guard.check_every_n_steps=1")


def model_parallel_4() -> dict[str, dict]:
    return by_strategy(sweep(*MODEL_PARALLEL_4))


def shape_of(summary: dict) -> tuple[CommShape, int]:
    """The GPT's sizes and the pipeline micro-batch count of a QUICK run, from the model's preset and
    the quick experiment's data config (not copied numbers)."""
    cfg = GPTConfig(**PRESETS[summary["model"]])
    seq = OmegaConf.load(ROOT / "lightning_par/conf/experiment/quick.yaml").data.seq_len
    mesh = summary["mesh"]
    dp = mesh.get("dp_replicate", 1) * mesh.get("dp_shard", 1)
    m = mesh.get("pp", 1) if mesh.get("pp", 1) > 1 else 1  # n_microbatches null: one per pipeline rank
    micro = summary["global_batch_size"] // dp // m
    shape = CommShape(shape=Shape.of_gpt(cfg, seq), micro_batch=micro)
    return shape, m


def predicted(summary: dict) -> dict[str, dict[str, int]]:
    shape, m = shape_of(summary)
    return step_comm_bytes(summary["strategy"], n_params=summary["n_params"], mesh=summary["mesh"], dtype_bytes=4,
                           shape=shape, micro_batches=m, zero2_collectives="all_reduce")  # zero2's on gloo


def assert_comm_matches(summary: dict, cross_check: bool = True) -> None:
    """The run's own ``comm_predicted`` (costs/run_prediction.py) equals its measured ``comm`` within 2%
    per (kind, axis); ``cross_check``: and equals the model asked here from the preset and the quick
    experiment's data config (no accumulation), so the callback read the run's shape right."""
    comm, want = summary["comm"], summary["comm_predicted"]
    where = f"{summary['strategy']} x{summary['world_size']} {summary['mesh']}"
    assert want is not None, (where, summary.get("comm_predicted_note"))
    if cross_check:
        assert want == predicted(summary), where
    got = comm["bytes_per_step"]
    assert comm["steps_measured"] and len(comm["per_rank"]) == summary["world_size"], where
    assert {(k, a) for k, ax in got.items() for a in ax} == {(k, a) for k, ax in want.items() for a in ax}, \
        f"{where}: measured {got}, predicted {want}"
    for kind, axes in want.items():
        for axis, nbytes in axes.items():
            assert abs(got[kind][axis] - nbytes) <= 0.02 * nbytes, f"{where} {kind}/{axis}: {got[kind][axis]} vs {nbytes}"


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "fsdp", "zero3_offload"])
def test_two_ranks_accumulating_bytes_match_model(strategy):
    """2 accumulated micro-batches (checkpointed blocks): FSDP gathers and reduce-scatters in every
    micro-batch (measured 2x one step's), DDP, ZeRO-1 and ZeRO-2 reduce once per step."""
    assert_comm_matches(two_ranks_accumulating()[strategy], cross_check=False)


def test_fsdp_without_resharding_gathers_the_root_again(tmp_path):
    """``reshard_after_forward=false``: every unit is gathered once, and the root (embeddings, final norm,
    head) once more in backward -- the model counted only the once (measured 1.157x of it for gpt_tiny)."""
    from tests.helpers import QUICK, train_summary

    s = train_summary([*QUICK, "strategy=fsdp", "strategy.reshard_after_forward=false", "trainer.devices=2",
                       "trainer.max_steps=3"], tmp_path)
    assert_comm_matches(s, cross_check=False)
    shape, _ = shape_of(s)
    gathered = s["comm"]["bytes_per_step"]["all_gather"]["dp_shard"]
    assert gathered == 4 * (s["n_params"] + shape.root_params())


@pytest.mark.slow
def test_fsdp_reduces_gradients_once_per_step_with_grad_sync_last_micro_batch():
    """``strategy.grad_sync=last_micro_batch`` (FSDP2's set_requires_gradient_sync) under 2 accumulated
    micro-batches at 4 ranks: fsdp and hsdp reduce-scatter (and hsdp all-reduces) once per step, as
    the 4-rank runs without accumulation do, while gathering per micro-batch (2x theirs); measured
    equals predicted within 2%, and the losses equal the accumulating 2-rank fsdp run's (rtol 1e-5)."""
    from tests.helpers import assert_losses_match

    runs = by_strategy(sweep(*GRAD_SYNC_LAST))
    every = two_ranks_accumulating()["fsdp"]
    for name in ("fsdp", "hsdp"):
        s, plain = runs[name], four_ranks()[name]
        assert_comm_matches(s, cross_check=False)
        got, ref = s["comm"]["bytes_per_step"], plain["comm"]["bytes_per_step"]
        assert got["reduce_scatter"] == ref["reduce_scatter"], (name, got, ref)
        assert got["all_gather"]["dp_shard"] == 2 * ref["all_gather"]["dp_shard"], (name, got, ref)
        if name == "hsdp":
            assert got["all_reduce"]["dp_replicate"] == ref["all_reduce"]["dp_replicate"], (got, ref)
        assert_losses_match(s, every)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "fsdp", "tensor_parallel", "pipeline"])
def test_two_ranks_bytes_match_model(strategy):
    s = long_parity()[strategy]
    assert_comm_matches(s)
    if strategy == "ddp":  # the seeds' figure, stated plainly: one all-reduce of every fp32 gradient
        assert s["comm"]["bytes_per_step"] == {"all_reduce": {"dp_replicate": 4 * s["n_params"]}}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp"])
def test_four_ranks_data_parallel_bytes_match_model(strategy):
    assert_comm_matches(four_ranks()[strategy])


@pytest.mark.parametrize("strategy", ["tensor_parallel", "pipeline", "fsdp_tp", "3d"])
def test_four_ranks_model_parallel_bytes_match_model(strategy):
    # RunGuard all-reduces its flags after every step here; an exact match means none of it was counted
    assert_comm_matches(model_parallel_4()[strategy])


ACCUMULATING_4 = ("strategy=tensor_parallel,fsdp_tp,3d", "strategy.sequence_parallel=false,true", "trainer.devices=4",
                  "+model.n_head=4", "trainer.max_steps=3", "trainer.accumulate_grad_batches=2")
GRAD_SYNC_LAST = ("strategy=fsdp,hsdp", "trainer.devices=4", "trainer.accumulate_grad_batches=2",
                  "strategy.activation_checkpointing=true", "strategy.grad_sync=last_micro_batch")
HSDP_PIPELINE_ACCUMULATING = ("strategy=hsdp,pipeline", "trainer.devices=4", "+model.n_head=4", "trainer.max_steps=3",
                              "trainer.accumulate_grad_batches=2")
# this module's own sweeps (the others are sweeps.py's, shared), run one after another in one process when the
# first is needed (sweeps.together)
together(MODEL_PARALLEL_4, ACCUMULATING_4, GRAD_SYNC_LAST, HSDP_PIPELINE_ACCUMULATING)


@pytest.mark.parametrize("strategy", ["tensor_parallel", "fsdp_tp", "3d"])
def test_four_ranks_accumulating_and_sequence_parallel_bytes_match_model(strategy):
    """The model-parallel strategies with 2 accumulated micro-batches (activations travel per
    micro-batch; FSDP gathers per micro-batch, under a pipeline once per step), without and with
    sequence parallelism: its all-reduces become reduce-scatters and all-gathers of the sequence
    shard, the pipeline sends the shard, and the LayerNorms' gradients are all-reduced once per step
    (per micro-batch under FSDP). Without accumulation: test_four_ranks_model_parallel_bytes_match_model."""
    out = sweep_dir(*ACCUMULATING_4)
    runs = {}
    for job in (p for p in out.iterdir() if p.is_dir() and p.name.isdigit()):
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        if f"strategy={strategy}\n" in overrides:
            sp = "strategy.sequence_parallel=true" in overrides.lower()
            runs[sp] = json.loads((job / "summary.json").read_text())
    assert set(runs) == {False, True}
    for s in runs.values():
        assert_comm_matches(s, cross_check=False)
    got = runs[True]["comm"]["bytes_per_step"]
    assert "reduce_scatter" in got and got["reduce_scatter"].get("tp"), got  # SP's own collective, measured


@pytest.mark.parametrize("strategy", ["tensor_parallel", "pipeline", "fsdp_tp", "3d"])
def test_estimate_json_predicts_the_runs_comm(strategy, tmp_path):
    """``mode=estimate`` writes each row's predicted bytes per step (``comm``, keyed as summary.json's);
    for the configured strategy they equal what the same config's run measured (the shared 4-rank sweep)."""
    from lightning_par.modes.estimate import run_estimate
    from tests.helpers import QUICK, composed

    args = [a for a in MODEL_PARALLEL_4 if not a.startswith("strategy=")] + [f"strategy={strategy}"]
    run_estimate(composed(*QUICK, *args, "mode=estimate", tmp=tmp_path))
    rows = {r["strategy"]: r for r in json.loads((tmp_path / "estimate.json").read_text())["strategies"]}
    want, got = rows[strategy]["comm"], model_parallel_4()[strategy]["comm"]["bytes_per_step"]
    assert rows["ddp"]["comm"] == {"all_reduce": {"dp_replicate": 4 * model_parallel_4()[strategy]["n_params"]}}
    assert {(k, a) for k, ax in got.items() for a in ax} == {(k, a) for k, ax in want.items() for a in ax}, (got, want)
    for kind, axes in want.items():
        for axis, nbytes in axes.items():
            assert abs(got[kind][axis] - nbytes) <= 0.02 * nbytes, (strategy, kind, axis, got, want)


@pytest.mark.parametrize("strategy", ["hsdp", "pipeline"])
def test_four_ranks_hsdp_and_pipeline_accumulating_bytes_match_model(strategy):
    """The two strategies no other sweep accumulates with: HSDP reduce-scatters and all-reduces across
    replicas every micro-batch; a pipeline moves each micro-batch's activations (2 accumulated
    micro-batches, 4 ranks)."""
    runs = by_strategy(sweep(*HSDP_PIPELINE_ACCUMULATING))
    assert_comm_matches(runs[strategy], cross_check=False)


def _classify(rank: int, world: int) -> dict:
    """A collective issued from a callback's frame is bookkeeping; the same from elsewhere is not."""
    import torch
    import torch.distributed as dist

    from lightning_par.callbacks.comm import _Recorder

    scope: dict = {"dist": dist, "torch": torch}
    exec(compile("def callback_reduce():\n    dist.all_reduce(torch.ones(3))\n",
                 "/x/lightning_par/callbacks/fake_callback.py", "exec"), scope)
    with _Recorder() as rec:
        scope["callback_reduce"]()
        dist.all_reduce(torch.ones(5))
        dist.broadcast(torch.ones(2), src=0)
    return {f"{kind}/{own}": n for (kind, _, own), n in rec.bytes.items()}


def test_callback_collectives_are_bookkeeping():
    from tests.dist import run_distributed

    for got in run_distributed(_classify, 2, timeout=90):
        assert got == {"all_reduce/True": 12, "all_reduce/False": 20, "broadcast/False": 8}


def test_every_strategy_writes_comm():
    runs = {**long_parity(), **four_ranks(), **model_parallel_4()}
    offload = two_ranks_accumulating()["zero3_offload"]  # 2 accumulated micro-batches, checkpointed blocks
    runs["zero3_offload"] = offload
    assert set(ALL) <= set(runs)
    got = offload["comm"]["bytes_per_step"]
    assert set(got) == {"all_gather", "reduce_scatter"} and got["reduce_scatter"]["dp_shard"] >= 4 * offload["n_params"]
    for name in ALL:
        comm = runs[name]["comm"]
        assert comm is not None and "bytes_per_step" in comm and comm["method"], name
        assert runs[name]["comm_predicted"] is not None, (name, runs[name].get("comm_predicted_note"))
    assert runs["single"]["comm"]["bytes_per_step"] == {} == runs["single"]["comm_predicted"]
    # payload: ZeRO-3 gathers 2Ψ and reduce-scatters Ψ, DDP all-reduces Ψ (on the links: 3Ψ vs 2Ψ, 1.5x)
    ddp, zero3 = runs["ddp"]["comm"]["total_bytes_per_step"], runs["zero3"]["comm"]["total_bytes_per_step"]
    assert zero3 == 3 * ddp


def test_collectives_benchmark_two_ranks_gloo(tmp_path, capsys):
    from lightning_par.tools.collectives import OPS, main

    rc = main(["--ranks", "2", "--backend", "gloo", "--min", "1K", "--max", "4K", "--iters", "2", "--warmup", "1",
               "--out", str(tmp_path), "--timeout", "120"])
    assert rc == 0
    data = json.loads((tmp_path / "collectives_gloo_2ranks.json").read_text())
    assert (tmp_path / "collectives_gloo_2ranks.png").stat().st_size > 0
    rows = data["rows"]
    assert {(r["op"], r["size"]) for r in rows} == {(op, s) for op in OPS for s in (1024, 4096)}
    factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5, "broadcast": 1.0}
    for r in rows:  # nccl-tests' definitions at n=2
        assert r["time_us"] > 0
        assert r["algbw_gbs"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9, rel=1e-9)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * factor[r["op"]], rel=1e-12)
    assert "busbw" in capsys.readouterr().out


def test_collectives_benchmark_refuses_bad_input(capsys):
    from lightning_par.tools.collectives import main

    assert main(["--ops", "all_reduce,allgather"]) == 2
    assert capsys.readouterr().err.strip() == "error: unknown op 'allgather' (choose from all_reduce, all_gather, " \
                                              "reduce_scatter, all_to_all, broadcast)"


def test_sweep_report_shows_comm(tmp_path):
    from lightning_par.tools.report import build_report

    for i, s in enumerate([long_parity()["ddp"], long_parity()["zero3"]]):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "summary.json").write_text(json.dumps(s))
    report, runs, _ = build_report(tmp_path)
    md = report.read_text()
    assert "comm per step" in md and "](comm.png)" in md
    assert (tmp_path / "comm.png").read_bytes().startswith(b"\x89PNG")
    ddp = 4 * runs[0].summary["n_params"]
    from lightning_par.tools.report import fmt_bytes
    assert f"| {fmt_bytes(ddp)} |" in md and f"| {fmt_bytes(3 * ddp)} |" in md


def test_comm_model_layouts_and_refusals():
    from lightning_par.costs.comm import bus_factor, predicted_seconds, total_bytes

    shape = CommShape(shape=Shape(n_layer=4, n_embd=8, n_head=1, vocab_size=16, seq_len=4), micro_batch=2)
    a = shape.activation_bytes(4)
    # zbv places stages r and 2p-1-r on rank r: the middle boundary stays on rank p-1 and costs nothing
    zbv = step_comm_bytes("pipeline", n_params=100, mesh={"pp": 2}, shape=shape, micro_batches=2, schedule="zbv",
                          virtual_stages=2)
    loop = step_comm_bytes("pipeline", n_params=100, mesh={"pp": 2}, shape=shape, micro_batches=2,
                           schedule="interleaved_1f1b", virtual_stages=2)
    assert zbv["send"]["pp"] == 2 * 2 * a and loop["send"]["pp"] == 3 * 2 * a
    assert step_comm_bytes("zero2", n_params=10, mesh={"dp_shard": 4})["all_gather"]["dp_shard"] == 12 * 4  # padded
    # zero2 reduces every micro-batch's gradients from its backward hooks, gathers the parameters once; on
    # gloo it runs all-reduce + broadcasts (the same payload)
    acc = step_comm_bytes("zero2", n_params=10, mesh={"dp_shard": 4}, accumulate=3, param_tensors=0)
    assert acc == {"reduce_scatter": {"dp_shard": 3 * 48}, "all_gather": {"dp_shard": 48}}
    acc = step_comm_bytes("zero2", n_params=10, mesh={"dp_shard": 4}, accumulate=3, param_tensors=2,
                          zero2_collectives="all_reduce")
    assert acc == {"all_reduce": {"dp_shard": 3 * 48 + 4 * 2}, "broadcast": {"dp_shard": 48}}
    # zero2's per-step flags: one 4-byte count per parameter tensor (+4 bytes of norm when clipping); the
    # shape's count is the real GPT's, with and without biases
    import torch

    from lightning_par.models.gpt import GPT
    for bias in (True, False):
        cfg = GPTConfig(**{**PRESETS["gpt_tiny"], "bias": bias})
        with torch.device("meta"):
            n = len(list(GPT(cfg).parameters()))
        gpt = CommShape(shape=Shape.of_gpt(cfg, 8), micro_batch=1)
        assert gpt.param_tensors() == n
        assert step_comm_bytes("zero2", n_params=10, mesh={"dp_shard": 2}, shape=gpt, grad_clip=True)["all_reduce"] \
            == {"dp_shard": 4 * (n + 1)}
    assert step_comm_bytes("fsdp", n_params=10, mesh={"dp_shard": 2}, reshard_after_forward=False)["all_gather"] \
        == {"dp_shard": 40}
    assert step_comm_bytes("ddp", n_params=10, mesh={"dp_replicate": 1}) == {}
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == 0.75
    ddp = step_comm_bytes("ddp", n_params=10**9, mesh={"dp_replicate": 8}, dtype_bytes=2)
    assert total_bytes(ddp) == 2 * 10**9
    assert predicted_seconds(ddp, {"dp_replicate": 8}, {"dp_replicate": 100.0}) == pytest.approx(2e9 * 1.75 / 1e11)
    for bad in (dict(strategy="tensor_parallel"), dict(strategy="ring_attention"),
                dict(strategy="tensor_parallel", shape=shape, loss_parallel=True)):
        with pytest.raises(ValueError, match="comm_model"):
            step_comm_bytes(n_params=10, mesh={"tp": 2}, **bad)
