"""LoRA and QLoRA in the cost model (issue 33, "Costs and advice").

- The estimator: a frozen parameter is a weight only (no gradient, no optimizer state); the adapters train; with
  ``lora.base=nf4`` the adapted linears' base weights are torchao NF4 (``states.nf4_bytes``, to the byte). What a
  block saves for backward with adapters on a frozen base (``activations.lora_layer_bytes_per_token``: a frozen
  linear keeps no input, ``lora_B`` keeps ``A``'s output, RMSNorm's frozen weight no normalised input, the first
  block and the head less again) is checked to the byte with ``saved_tensors_hooks``, and a step's peak against
  torch's ``MemTracker`` on one device; per-rank model states and communication against QLoRA under fsdp at 2 ranks,
  and communication against LoRA under tensor and sequence parallelism at 2 ranks.
- The step model: a frozen weight skips its weight-gradient matmul (4 FLOPs per weight and token, not 6), equal to
  torch's FLOP counter.
- The advisor (``--finetune``): an 8B Llama on one 24 GB GPU gets QLoRA, a 1B Llama on 8 x 80 GB full fine-tuning;
  each printed command trains 2 steps scaled down on CPU, and the QLoRA run's measured model states equal the
  estimate of the command it ran.

The module's four training runs (the two commands, the two 2-rank runs) run one after another in one process
(``runs``): about 22 s of the module's 30 on 2 cores.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
from pathlib import Path

import pytest
import torch

from lightning_par.callbacks.memory import stored_tensors
from lightning_par.costs.activations import layer_bytes_per_token, lora_model_bytes, weight_copy_bytes
from lightning_par.costs.estimate import estimate
from lightning_par.costs.shape import Shape
from tests.helpers import saved_bytes_of_layer
from lightning_par.costs.states import nf4_bytes
from lightning_par.costs.step_time import flops_per_token, forward_flops_per_token
from lightning_par.parallel.adapters.lora import apply_lora, lora_option, quantize_bases, to_nf4

pytestmark = pytest.mark.timeout(600)


def tiny(arch: str, lora: dict | None, *, layers: int = 2, hidden: int = 64, vocab: int = 256, seq: int = 64,
         device: str | None = None) -> tuple[torch.nn.Module, Shape]:
    """Our GPT (no biases) or a transformers Llama (grouped-query, 2 of 4 heads) with ``lora`` applied as the
    LightningModule applies it (``ParModule.adapt``: our GPT's output head excluded), its base quantised to NF4
    where asked; and its shape, LoRA included."""
    torch.manual_seed(0)
    with torch.device(device) if device else contextlib.nullcontext():
        if arch == "gpt":
            from lightning_par.models.gpt import GPT

            shape = Shape(layers, hidden, 4, vocab, seq, bias=False)
            net = GPT(shape.gpt_config()).train()
            exclude = [net.get_output_embeddings()]
        else:
            from lightning_par.models.hf.causal_lm import LogitsOnly, _transformers, hf_config

            cfg = hf_config("llama", hidden=hidden, layers=layers, heads=4, kv_heads=2, intermediate=2 * hidden,
                            vocab=vocab, max_positions=seq, tie_word_embeddings=False)
            shape = Shape.of_hf(cfg, seq)
            net = LogitsOnly(_transformers().AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")).train()
            exclude = []
    if lora:
        cfg = lora_option(lora)
        apply_lora(net, cfg, exclude=exclude)
        if cfg.base == "nf4" and device != "meta":
            quantize_bases(net)
        shape = shape.with_lora(cfg)
    return net, shape


def blocks(net: torch.nn.Module) -> torch.nn.ModuleList:
    return net.blocks if hasattr(net, "blocks") else net.net.model.layers


# ------------------------------------------------------------------------------------------------ NF4 storage
def test_nf4_bytes_are_the_stored_bytes():
    """``states.nf4_bytes`` equals the storages of the NF4Tensor QLoRA makes (``lora.to_nf4``), as the memory
    callback counts them: 4-bit codes, int8 block scalers, the scalers' scales and mean, the code table -- for a
    large weight (0.516 bytes per value) and small ones (fewer scale groups; one, whose row of scales is kept)."""
    for dtype in (torch.float32, torch.bfloat16):
        for rows, cols in ((512, 2048), (192, 64), (64, 64), (2, 64)):
            w = torch.randn(rows, cols, dtype=dtype)
            stored = sum(t.untyped_storage().nbytes() for t in stored_tensors([to_nf4(w)]))
            assert stored == nf4_bytes(w.numel(), w.element_size()), (rows, cols, dtype)
    assert nf4_bytes(4096 * 4096, 2) / 4096**2 == pytest.approx(0.5157, abs=1e-4)
    assert nf4_bytes(100, 4) == 400  # not a multiple of NF4's 64-value block: counted in its dtype


# ------------------------------------------------------------------------------------------------ activations
LAYER_CASES = {
    "gpt-default-fp32": ("gpt", "32-true", {"rank": 4}),
    "gpt-default-bf16": ("gpt", "bf16-mixed", {"rank": 4}),
    "gpt-q-v-bf16": ("gpt", "bf16-mixed", {"rank": 4, "targets": ["wq", "wv"]}),
    "gpt-dropout-fp32": ("gpt", "32-true", {"rank": 4, "dropout": 0.1}),
    "gpt-nf4-fp32": ("gpt", "32-true", {"rank": 4, "base": "nf4"}),
    "llama-default-fp32": ("llama", "32-true", {"rank": 4}),
    "llama-q-v-fp32": ("llama", "32-true", {"rank": 4, "targets": ["q_proj", "v_proj"]}),
    "llama-dropout-bf16": ("llama", "bf16-mixed", {"rank": 4, "dropout": 0.1}),
    "llama-nf4-bf16": ("llama", "bf16-mixed", {"rank": 4, "base": "nf4"}),
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_a_lora_layer_saves_what_the_estimator_counts(case):
    """A block with adapters on a frozen base saves, to the byte, ``layer_bytes_per_token`` x tokens + autocast's
    weight copies (the adapters' too; none of an NF4 weight's). The first block saves less (the embedding is frozen,
    so its first norm keeps nothing, nor, under autocast, the attention-input linears their weight copies;
    ``lora_model_bytes``): within 1% of the estimate, and a Llama's first layer also holds RoPE's cos/sin, shared by
    every layer (fp32, per position and head dimension)."""
    arch, precision, lora = LAYER_CASES[case]
    net, shape = tiny(arch, lora)
    B, T = 2, shape.seq_len
    x = torch.randint(0, shape.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    lo, u = shape.lora_units(), shape.units()
    nf4 = lo["block_adapted"] if shape.lora.base == "nf4" else 0
    want = layer_bytes_per_token(shape, precision, device="cpu") * B * T + weight_copy_bytes(
        u["block_matmul"] + lo["block_lora"] - nf4, precision)
    got = saved_bytes_of_layer(net, blocks(net)[1], x, precision)
    assert got == want, f"{case}: saved {got:,} B, estimated {want:,.0f} B"
    per_token, fixed, _ = lora_model_bytes(shape, precision, device="cpu")
    first = want - per_token * B * T - fixed
    rope = 2 * T * (shape.n_embd // shape.n_head) * 4 if arch == "llama" else 0
    got0 = saved_bytes_of_layer(net, blocks(net)[0], x, precision)
    assert abs(got0 - first - rope) <= 0.01 * got0, f"{case}: first block saved {got0:,} B, estimated {first:,.0f} B"
    assert first < want  # the first block saves less than the others


def memtracker_peak(net: torch.nn.Module, shape: Shape, batch: int, precision: str, monkeypatch) -> int:
    """``tests/helpers.memtracker_step_peak``, with MemTracker told that a frozen parameter is hooked already: it
    hooks every parameter's gradient, and ``register_hook`` refuses one that needs none (as costs/traced.py does)."""
    from torch.distributed._tools import mem_tracker

    from tests.helpers import memtracker_step_peak

    class _NoHook:
        def remove(self) -> None:
            pass

    track = mem_tracker.MemTracker.track_external

    def track_frozen(self, *external):
        for m in external:
            for p in (m.parameters() if isinstance(m, torch.nn.Module) else ()):
                if not p.requires_grad:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        return track(self, *external)

    monkeypatch.setattr(mem_tracker.MemTracker, "track_external", track_frozen)
    return memtracker_step_peak(net, shape.vocab_size, batch, shape.seq_len, precision)


# (arch, precision, lora); measured: 0.998-1.000 of MemTracker's peak
PEAK_CASES = {
    "gpt-lora-bf16": ("gpt", "bf16-mixed", {"rank": 8}),
    "gpt-qlora-fp32": ("gpt", "32-true", {"rank": 8, "base": "nf4"}),
    "llama-lora-fp32": ("llama", "32-true", {"rank": 8}),
    "llama-qlora-bf16": ("llama", "bf16-mixed", {"rank": 8, "base": "nf4"}),
}


@pytest.mark.parametrize("case", list(PEAK_CASES))
def test_lora_step_peak_within_2_percent_of_memtracker(case, monkeypatch):
    """One training step's peak on one device (after a warm-up step: the adapters' AdamW states exist) against the
    estimate: parameters (frozen ones in their dtype or NF4), the adapters' gradients and states only, the
    activations above, the loss buffers."""
    arch, precision, lora = PEAK_CASES[case]
    net, shape = tiny(arch, lora, layers=4, hidden=128, vocab=512, seq=128)
    est = estimate(shape, devices=1, strategy="single", precision=precision, micro_batch_size=4, device="cpu")
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    assert est.grads == 4 * trainable and est.optimizer_state == 8 * trainable == 8 * shape.trainable()
    assert est.params == sum(t.untyped_storage().nbytes() for t in stored_tensors(net.parameters()))
    got = memtracker_peak(net, shape, 4, precision, monkeypatch)
    assert abs(est.peak - got) <= 0.02 * got, f"{case}: estimated {est.peak:,} B ({est.moment}), MemTracker {got:,} B"


# ------------------------------------------------------------------------------------------------ step time
@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("targets", [None, ["wq", "wk", "wv", "q_proj", "k_proj", "v_proj"]])
def test_frozen_weights_skip_their_weight_gradient_flops(arch, targets):
    """torch's FLOP counter over forward + backward on the meta device equals ``flops_per_token``: 4 per frozen
    weight (the first block's attention inputs 2), adapted or not (the MLP's, with adapters on attention only), 6
    per adapter weight; the forward ``forward_flops_per_token``. (Adapters on q and v alone would leave the first
    block's k without a gradient, which the math attention on the meta device then skips and the fused kernels do
    not: not counted.)"""
    from torch.utils.flop_counter import FlopCounterMode

    lora = {"rank": 8, **({"targets": targets} if targets else {})}
    net, shape = tiny(arch, lora, device="meta")
    B = 2
    x = torch.zeros(B, shape.seq_len, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as forward:
        with torch.no_grad():
            net(x)
    with FlopCounterMode(display=False) as step:
        net(x).float().sum().backward()
    tokens = B * shape.seq_len
    assert step.get_total_flops() == flops_per_token(shape) * tokens
    assert forward.get_total_flops() == forward_flops_per_token(shape) * tokens
    full = flops_per_token(tiny(arch, None, device="meta")[1])
    assert flops_per_token(shape) < 0.85 * full  # no weight gradients for the base (attention's FLOPs stay)


# ------------------------------------------------------------------------------------------------ the advisor
LLAMA_8B = ["--params", "8.03e9", "--layers", "32", "--hidden", "4096", "--vocab", "128256", "--kv-heads", "8",
            "--intermediate", "14336"]
FINETUNE = {
    "8b-one-24gb": ([*LLAMA_8B, "--devices-per-node", "1", "--device-memory", "24", "--finetune"], 1),
    "1b-8x80": (["--model", "hf_llama_1b", "--devices-per-node", "8", "--device-memory", "80", "--finetune"], 2),
}


@pytest.fixture(scope="module")
def finetune_answers() -> dict[str, str]:
    from lightning_par.modes.advise import main

    out = {}
    for name, (args, _) in FINETUNE.items():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            main(args)
        out[name] = printed.getvalue()
    return out


def _command(out: str) -> str:
    (command,) = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("lightning-par ")]
    return command


def test_finetune_8b_on_one_24gb_gets_qlora(finetune_answers):
    """Full fine-tuning fits one 24 GB GPU only offloaded (seconds per step), LoRA's fp32 base (32 GB under
    bf16-mixed) only offloaded too; QLoRA's NF4 base fits the device: QLoRA, with every method's cost shown."""
    out = finetune_answers["8b-one-24gb"]
    assert out.splitlines()[0].startswith("Recommended: single") and "(QLoRA rank 16)" in out.splitlines()[0], out
    names = ("full fine-tuning", "LoRA rank 16", "QLoRA rank 16")
    table = {name: ln for ln in out.splitlines() for name in names
             if ln[:2] in ("> ", "  ") and ln[2:].startswith(name + " ")}
    assert set(table) == {"full fine-tuning", "LoRA rank 16", "QLoRA rank 16"}, out
    assert table["QLoRA rank 16"].startswith("> ") and "zero3_offload" in table["full fine-tuning"]
    command = _command(out)
    assert "model.lora.rank=16" in command and "model.lora.alpha=32" in command and "model.lora.base=nf4" in command
    assert "more than 2x" in out and "torchao, for model.lora.base=nf4" in out


def test_finetune_1b_on_8x80_keeps_full_finetuning(finetune_answers):
    out = finetune_answers["1b-8x80"]
    assert "(full fine-tuning)" in out.splitlines()[0] and "model.lora" not in _command(out), out
    assert "full fine-tuning fits" in out and "within 2x" in out


#: the 2-rank runs: QLoRA under fsdp, LoRA under tensor parallelism with sequence parallelism (gpt_tiny, quick)
TWO_RANKS = {"qlora-fsdp-2": ["strategy=fsdp", "model.lora.base=nf4"],
             "lora-tp-sp-2": ["strategy=tensor_parallel", "strategy.sequence_parallel=true"]}


@pytest.fixture(scope="module")
def runs(finetune_answers, tmp_path_factory) -> dict[str, tuple[int | None, Path, str]]:
    """Job -> (exit status, output directory, what its process printed) of the module's training runs, one after
    another in one process (``tests/serial.py``: they share the product's fork server of CPU ranks, started
    once), each by the console script ``lightning-par``: the advisor's two printed commands scaled down
    (``tests/test_advisor.py``'s ``scaled``: sizes substituted, 2 steps, the summary callbacks kept here) and
    the 2-rank runs of ``TWO_RANKS``."""
    from tests import serial
    from tests.helpers import QUICK
    from tests.test_advisor import BIN, scaled

    root = tmp_path_factory.mktemp("lora_runs")
    words = {case: [w for w in scaled(_command(finetune_answers[case]), devices) if w != "callbacks=none"]
             for case, (_, devices) in FINETUNE.items()}
    for job, args in TWO_RANKS.items():
        words[job] = [*QUICK, *args, "trainer.devices=2", "model.lora.rank=4", "trainer.max_steps=3"]
    spec = {job: [*args, f"paths.output_dir={root / job}", f"hydra.run.dir={root / job / 'run'}"]
            for job, args in words.items()}
    done = serial.run(spec, root / "process", script=BIN / "lightning-par", env=dict(os.environ), timeout=600)
    return {job: (done[job].returncode, root / job, f"{done[job].stdout[-3000:]}\n{done[job].stderr[-6000:]}")
            for job in spec}


@pytest.mark.parametrize("case", list(FINETUNE))
def test_finetune_command_trains_scaled_down(case, finetune_answers, runs):
    """Each printed command trains 2 steps scaled down on CPU. The QLoRA one's measured model states (its NF4
    base's storages, the adapters' gradients and AdamW states) are the estimate of the command it ran: its model
    built from the same overrides, read by ``Shape.of_model`` (which takes LoRA from the module)."""
    from lightning_par.models.build import instantiate_model
    from tests.helpers import composed
    from tests.test_advisor import scaled

    command, devices = _command(finetune_answers[case]), FINETUNE[case][1]
    code, run_dir, printed = runs[case]
    assert code == 0, printed
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["world_size"] == devices and s["strategy"] == shlex.split(command)[1].split("=")[1]
    assert len(s["losses"]) == 2, s["losses"]
    if case != "8b-one-24gb":
        return
    cfg = composed(*[w for w in scaled(command, devices) if w != "callbacks=none"], tmp=run_dir)
    module = instantiate_model(cfg.model)
    shape = Shape.of_model(module, int(cfg.data.seq_len))
    assert shape.lora is not None and shape.lora.base == "nf4"
    exp = estimate(shape, devices=1, strategy="single", precision=str(cfg.trainer.precision), device="cpu")
    (m,) = s["memory"]
    tensors = shape.lora_units()["trainable_tensors"]
    assert (m["params"], m["grads"]) == (exp.params, exp.grads), (m, exp)
    assert exp.optimizer_state <= m["optimizer_state"] <= exp.optimizer_state + 4 * tensors, (m, exp)


# ------------------------------------------------------------------------------------------------ two ranks
def test_two_ranks_fsdp_qlora_states_and_comm(runs):
    """gpt_tiny with QLoRA (rank 4, NF4 base) under fsdp at 2 ranks: each rank's measured parameters (the frozen
    ones sharded too, the adapted linears' in NF4: each shard keeps its tensor's code table and mean whole),
    gradients and optimizer state (the adapters' only) are the estimate's, to the byte (+ AdamW's scalar steps);
    the measured communication equals the run's own prediction (``comm_predicted``, which reads LoRA from the
    model): every parameter all-gathered twice -- the NF4 ones in 4 bits, their scalers and scales --, only the
    adapters' gradients reduce-scattered."""
    from lightning_par.models.module import GPTModule

    code, run_dir, printed = runs["qlora-fsdp-2"]
    assert code == 0, printed
    s = json.loads((run_dir / "summary.json").read_text())
    module = GPTModule(preset=s["model"], lora={"rank": 4, "alpha": 16, "base": "nf4"})
    shape = Shape.of_model(module, 64)  # experiment=quick's sequence
    trainable, tensors = shape.trainable(), shape.lora_units()["trainable_tensors"]
    assert s["n_params"] == shape.units()["total"] and 0 < trainable < s["n_params"] / 10
    exp = estimate(shape, devices=2, strategy="fsdp", precision="32-true", micro_batch_size=4, device="cpu")
    assert exp.grads == 4 * trainable // 2 and exp.optimizer_state == 8 * trainable // 2
    for m in s["memory"]:
        assert (m["params"], m["grads"]) == (exp.params, exp.grads), (m, exp)
        assert exp.optimizer_state <= m["optimizer_state"] <= exp.optimizer_state + 4 * tensors, (m, exp)
    nf4_elements, nf4_gathered = shape.nf4_weights(4, gathered=True)
    gathered = 2 * (4 * (s["n_params"] - nf4_elements) + nf4_gathered)
    assert s["comm_predicted"] == {"all_gather": {"dp_shard": gathered}, "reduce_scatter": {"dp_shard": 4 * trainable}}
    assert s["comm"]["bytes_per_step"] == s["comm_predicted"], (s["comm"]["bytes_per_step"], s["comm_predicted"])
    full = estimate(Shape.of_model(GPTModule(preset=s["model"]), 64), devices=2, strategy="fsdp",
                    precision="32-true", micro_batch_size=4, device="cpu")
    assert exp.params < 0.5 * full.params and exp.grads < 0.1 * full.grads  # what QLoRA saves


def test_two_ranks_tensor_parallel_lora_comm(runs):
    """LoRA rank 4 under tensor parallelism with sequence parallelism at 2 ranks: the measured collectives equal the
    prediction to the byte -- the first block's attention input, the embedding's output and the position table need
    no gradient (the embedding is frozen), and the per-step all-reduce of the replicated parameters' partial
    gradients carries the adapters tensor parallelism does not split (colwise A, rowwise B) instead of the frozen
    norms'."""
    from lightning_par.models.module import GPTModule

    code, run_dir, printed = runs["lora-tp-sp-2"]
    assert code == 0, printed
    s = json.loads((run_dir / "summary.json").read_text())
    lo = Shape.of_model(GPTModule(preset=s["model"], lora={"rank": 4, "alpha": 16}), 64).lora_units()
    replicated = lo["block_trainable"] - lo["block_trainable_split"]
    assert s["comm_predicted"]["all_reduce"] == {"tp": 4 * 2 * replicated}  # gpt_tiny: 2 layers, fp32
    assert s["comm"]["bytes_per_step"] == s["comm_predicted"], (s["comm"]["bytes_per_step"], s["comm_predicted"])
