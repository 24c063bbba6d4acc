"""Pipeline stages of Hugging Face models run the model's own forward (``parallel/hf/stages.py``):
the masks (causal, sliding-window, Gemma's alternating sliding/full layers), position ids, rotary
tables, embedding scaling, final norm and logit soft-capping the whole model computes. Eager and
SDPA attention give the same losses; a model whose forward cannot be cut is refused before launch.

Decoder layers called with hidden states alone (the old pipeline) get no attention mask: eager
attention is then not causal, so every eager test here fails on that code.
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch

from lightning_par.models.hf.causal_lm import HFCausalLM
from lightning_par.models.module import cross_entropy
from lightning_par.parallel.hf.stages import check_hf_pipeline
from lightning_par.parallel.pipeline.schedule import build_schedule, build_stage_modules
from lightning_par.parallel.pipeline.stages import drop_remote_layers, measure_layer_times
from lightning_par.parallel.hf.stages import hf_stage_runner
from tests.dist import run_distributed
from tests.helpers import assert_losses_match, run_cli

SEQ = 32
WINDOW = 8  # shorter than SEQ: the sliding-window masks matter
ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
FAMILIES = {  # arch -> extra transformers config fields
    "llama": {},
    "qwen2": {},
    "mistral": {"sliding_window": WINDOW},
    "gemma2": {"sliding_window": WINDOW},  # soft-capped attention and logits, scaled embeddings; eager only
    "gemma3_text": {"sliding_window": WINDOW, "layer_types": ALTERNATING},
}
CASES = [(arch, attn) for arch in FAMILIES for attn in ("eager", "sdpa") if (arch, attn) != ("gemma2", "sdpa")]


def tiny(arch: str, attn: str, layers: int = 4) -> HFCausalLM:
    config = dict(FAMILIES[arch])
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:layers]
    return HFCausalLM(arch=arch, hidden=64, layers=layers, heads=4, kv_heads=2, intermediate=128,
                      max_positions=SEQ, attn_implementation=attn, config=config, optimizer="sgd")


def built(arch: str, attn: str, seed: int = 0) -> HFCausalLM:
    torch.manual_seed(seed)
    m = tiny(arch, attn)
    m.configure_model()
    return m


def _chain(m: HFCausalLM, bounds: list[int], x: torch.Tensor) -> torch.Tensor:
    layers = m.parallel_plan().layers
    stages = build_stage_modules(m, layers=layers, boundaries=bounds, stage_indices=range(len(bounds) - 1),
                                 stage_runner=hf_stage_runner)
    for stage in stages:
        x = stage(x)
    return x


# ---------------------------------------------------------------------------------------------
# One process: the stages, run one after another, compute exactly what the whole model does


@pytest.mark.parametrize("arch,attn", CASES)
def test_stages_compute_the_whole_model(arch, attn):
    m = built(arch, attn)
    x = torch.randint(0, 256, (2, SEQ))
    whole = m(x)
    n = len(m.parallel_plan().layers)  # embedding, 4 decoder layers, norm, head
    assert n == 7
    # a cut after the embedding (Gemma scales it there), between decoder layers, before the norm,
    # before the head (soft-capping), and one layer per stage
    for bounds in ([0, 1, n], [0, 3, n], [0, 2, 4, n], [0, 5, n], [0, n - 1, n], list(range(n + 1))):
        torch.testing.assert_close(_chain(m, bounds, x), whole, rtol=0, atol=0, msg=f"{arch} {attn} cut at {bounds}")


@pytest.mark.parametrize("arch", [a for a in FAMILIES if a != "gemma2"])
def test_eager_and_sdpa_are_the_same_model(arch):
    """The premise of the parity tests: one set of weights, both attentions, the same logits."""
    x = torch.randint(0, 256, (2, SEQ))
    eager, sdpa = built(arch, "eager"), built(arch, "sdpa")
    torch.testing.assert_close(eager(x), sdpa(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_chain(eager, [0, 3, 7], x), sdpa(x), rtol=1e-5, atol=1e-5)


def test_remote_layers_keep_what_the_forward_reads():
    m = built("gemma3_text", "eager")
    layers = m.parallel_plan().layers
    layer = m.get_submodule(layers[2])
    layer.attention_type = "sliding_attention"  # some families' forwards pick the mask by this attribute
    drop_remote_layers(m, layers, set(layers[:2]), {p: 0 if i < 2 else 1 for i, p in enumerate(layers)})
    remote = m.get_submodule(layers[2])
    assert type(remote).__name__ == "RemoteLayer" and remote.attention_type == "sliding_attention"
    assert not any(True for _ in remote.parameters())


def test_time_balance_measures_hf_layers_through_the_model():
    m = built("gemma2", "eager")
    layers = m.parallel_plan().layers
    times = measure_layer_times(m, layers, torch.randint(0, 256, (1, SEQ)), repeats=1, stage_runner=hf_stage_runner)
    assert len(times) == len(layers) and all(t > 0 for t in times)


# ---------------------------------------------------------------------------------------------
# Before launch


def test_every_family_passes_the_prelaunch_check():
    for arch, attn in CASES:
        m = tiny(arch, attn)
        check_hf_pipeline(m.build_hf("meta"), [p.removeprefix("net.") for p in m.parallel_plan().layers])


def test_a_plan_out_of_forward_order_is_refused_in_one_line():
    m = tiny("llama", "eager")
    m.configure_model()  # on the meta device, as before launch
    layers = list(m.parallel_plan().layers)
    layers[1], layers[2] = layers[2], layers[1]
    with pytest.raises(ValueError, match="does not call the layers of its pipeline plan once each, in plan order") as e:
        check_hf_pipeline(m, layers)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="lies outside it"):
        check_hf_pipeline(m, ["net.model.embed_tokens", "other.head"])


def test_gemma2_sdpa_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^HFCausalLM: gemma2 does not support attn_implementation=sdpa; use eager$"):
        tiny("gemma2", "sdpa")


# ---------------------------------------------------------------------------------------------
# Two processes: training through a 2-stage pipeline matches the single-device run (fp32, SGD)

STEPS, BATCH, MICRO = 8, 4, 2


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        seq = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def _sgd(params) -> torch.optim.Optimizer:  # noqa: ANN001
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _train_pipeline(rank: int, arch: str, attn: str, schedule: str = "1f1b") -> list[float]:
    m = built(arch, attn)
    layers = m.parallel_plan().layers
    if schedule == "1f1b":  # embedding + 2 decoder layers | 2 decoder layers, norm, head
        bounds, indices = [0, 3, len(layers)], [rank]
    else:  # 4 stages, 2 per rank (loop placement): rank 0 runs stages 0 and 2 -- the first and a middle one
        bounds, indices = [0, 2, 4, 6, len(layers)], [rank, rank + 2]
    owner = {p: s for s in range(len(bounds) - 1) for p in layers[bounds[s]:bounds[s + 1]]}
    stages = build_stage_modules(m, layers=layers, boundaries=bounds, stage_indices=indices, stage_runner=hf_stage_runner)
    drop_remote_layers(m, layers, {p for st in stages for p in st.layers}, owner)
    pipe = build_schedule(stages, schedule=schedule, n_microbatches=MICRO, loss_fn=cross_entropy,
                          virtual_stages=len(indices), stage_indices=indices)
    opt = _sgd([p for st in stages for p in st.parameters()])
    losses = []
    for step in range(STEPS):
        x, y = _batches()[step % 2]
        opt.zero_grad(set_to_none=True)
        losses.append(pipe.step(x if rank == 0 else None, y if rank == 1 else None).item())
        opt.step()
    return losses


def _train_single(arch: str, attn: str) -> list[float]:
    m = built(arch, attn)
    opt = _sgd(m.parameters())
    losses = []
    for step in range(STEPS):
        x, y = _batches()[step % 2]
        opt.zero_grad(set_to_none=True)
        loss = m.loss_fn(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _parity_worker(rank: int, world: int, cases: list[tuple[str, str]]) -> dict:
    logging.getLogger("lightning_par").setLevel(logging.WARNING)
    out = {}
    for arch, attn in cases:
        out[(arch, attn, "pipeline")] = _train_pipeline(rank, arch, attn)
        if rank == 0:  # the reference, while rank 1 waits for the next case
            out[(arch, attn, "single")] = _train_single(arch, attn)
    for arch, attn in INTERLEAVED:
        out[(arch, attn, "interleaved")] = _train_pipeline(rank, arch, attn, "interleaved_1f1b")
    return out


INTERLEAVED = [("gemma3_text", "eager"), ("mistral", "sdpa")]


@pytest.fixture(scope="module")
def parity_runs() -> dict:
    return run_distributed(_parity_worker, 2, CASES, timeout=540)[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch,attn", CASES)
def test_pipeline_trains_like_one_device(arch, attn, parity_runs):
    got, ref = np.asarray(parity_runs[(arch, attn, "pipeline")]), np.asarray(parity_runs[(arch, attn, "single")])
    assert len(got) == len(ref) == STEPS
    assert ref[-1] < ref[0] - 0.1, ref  # it learns, so a wrong gradient would show
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=0, err_msg=f"{arch} {attn}: pipeline vs single device")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch,attn", INTERLEAVED)
def test_interleaved_stages_train_like_one_device(arch, attn, parity_runs):
    """Two stages per rank: a rank runs the forward past layers it holds for its other stage."""
    got, ref = parity_runs[(arch, attn, "interleaved")], parity_runs[(arch, attn, "single")]
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=0, err_msg=f"{arch} {attn}: interleaved vs single device")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_eager_and_sdpa_pipelines_give_the_same_losses(parity_runs):
    for arch in FAMILIES:
        if (arch, "sdpa") in CASES:
            eager, sdpa = parity_runs[(arch, "eager", "pipeline")], parity_runs[(arch, "sdpa", "pipeline")]
            np.testing.assert_allclose(eager, sdpa, rtol=1e-5, err_msg=arch)


# ---------------------------------------------------------------------------------------------
# End to end through the app: the pipeline and 3d strategies on Gemma-2 (eager only, sliding
# window shorter than the sequence, soft-capping), fp32 SGD, against the single-device run

E2E = ["model=hf_causal_lm", "model.arch=gemma2", "model.attn_implementation=eager", "model.layers=4",
       "+model.config.sliding_window=16", "model.optimizer=sgd", "model.lr=0.2", "+model.momentum=0.9",
       "trainer.max_steps=10", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
       "data.seq_len=64", "data.global_batch_size=8", "data.max_bytes=400000"]
E2E_LAYOUTS = {"single": 1, "pipeline": 2, "3d": 4}


@pytest.fixture(scope="module")
def gemma2_runs(tmp_path_factory) -> dict:
    """The three runs (single, pipeline at 2 ranks, 3d at 4), one after another in one process
    (``tests/serial.py``: each as its ``python run.py ...`` command runs it)."""
    from tests import serial

    return serial.app_runs({s: [f"strategy={s}", f"trainer.devices={d}", *E2E] for s, d in E2E_LAYOUTS.items()},
                           tmp_path_factory.mktemp("gemma2"), timeout=900)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy,devices", [("pipeline", 2), ("3d", 4)])
def test_gemma2_eager_strategy_parity(strategy, devices, gemma2_runs):
    ref = gemma2_runs["single"].summary()
    got = gemma2_runs[strategy].summary()
    assert E2E_LAYOUTS[strategy] == devices and got["world_size"] == devices
    assert_losses_match(got, ref, rtol=1e-6, atol=0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_uncuttable_model_is_refused_before_launch(tmp_path):
    """A pipeline plan naming the decoder layers before the embedding does not match the forward."""
    plan = "{layers: [[hidden_states], [hidden_states]], embed_tokens: [[input_ids], [inputs_embeds]], " \
           "norm: [[hidden_states], [hidden_states]]}"
    proc = run_cli(["model=hf_llama_tiny", f"+model.config={{base_model_pp_plan: {plan}}}", "strategy=pipeline",
                    "trainer.devices=2", "trainer.max_steps=2"], tmp_path, timeout=240, check=False)
    assert proc.returncode != 0
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "cannot be cut" in lines[0], (proc.stdout + proc.stderr)[-3000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "summary.json").exists()


def test_module_copy_does_not_copy_the_model():
    m = built("llama", "eager")
    stage = build_stage_modules(m, layers=m.parallel_plan().layers, boundaries=[0, 3, 7], stage_indices=[1], stage_runner=hf_stage_runner)[0]
    twin = copy.deepcopy(stage)
    assert twin.runner._root() is m  # the runner refers to the model weakly: a copy shares it
