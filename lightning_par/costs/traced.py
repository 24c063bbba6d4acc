"""Memory of one training step of *any* model, measured on fake tensors: the estimator's input for
models whose shape it does not model op by op (Hugging Face models, a user's own module).

``trace_step`` builds the model under torch's ``FakeTensorMode`` (no storage is allocated), runs one
training step at the asked micro-batch -- forward under the run's precision, the module's loss,
backward, the optimizer step -- and has torch's ``MemTracker`` account it, by category (parameters,
gradients, optimizer states, activations, temporaries), at two moments: the peak of forward and
backward, and the peak of the optimizer step. Everything the model does is in the trace: grouped-
query attention, tied embeddings, gated MLPs, rotary tables, the attention kernel torch picks, the
loss's fp32 logits. On the CPU it equals MemTracker on real tensors to the byte; the kernels are the
CPU's (on CUDA, flash attention saves less than the CPU's SDPA: the estimate is then an upper bound
for attention).

``lightning_par.costs.estimate.estimate_traced`` turns the two moments into a per-rank peak for each
data-parallel strategy (its states sharded as the strategy shards them, FSDP's gathered units
added). Why not torch's ``FSDPMemTracker`` or a real run: both need the processes and the memory.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch

from lightning_par.costs.states import BLOCK_8BIT, MIN_8BIT

CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")  # _MemRefType


@dataclass(frozen=True)
class Moment:
    """Bytes by MemTracker category at one moment of the step (its per-device total)."""

    params: int
    buffers: int
    grads: int
    activations: int
    temp: int
    optimizer_state: int
    other: int

    @property
    def total(self) -> int:
        return (self.params + self.buffers + self.grads + self.activations + self.temp + self.optimizer_state
                + self.other)

    @classmethod
    def of(cls, snapshot: dict[Any, dict[str, int]]) -> Moment:
        merged = {c: sum(int(d.get(c, 0)) for d in snapshot.values()) for c in CATEGORIES}
        return cls(merged["Parameter"], merged["Buffer"], merged["Gradient"], merged["Activation"], merged["Temp"],
                   merged["Optstate"], merged["Other"])


@dataclass(frozen=True)
class TracedStep:
    """One device's step: the peak of forward + backward, the peak of the optimizer step, the
    parameter count and the largest FSDP unit's and the root's parameters (``units``)."""

    backward: Moment
    step: Moment
    n_params: int
    param_bytes: int  # bytes per parameter element as trained (4 under fp32 and bf16-mixed, 2 under bf16-true)
    largest_unit: int  # parameters of the largest block (the model's no-split modules)
    root: int  # parameters outside every block (embeddings, final norm, head)
    micro_batch: int
    seq_len: int | None
    largest_tensor: int = 0  # elements of the largest parameter (ZeRO-2: a bucket of its own when larger)
    #: of ``n_params``, those that train (LoRA: the adapters; None: all), and of the largest block's
    trainable: int | None = None
    largest_unit_trainable: int | None = None

    @property
    def peak(self) -> int:
        return max(self.backward.total, self.step.total)


def _precision_context(precision: str, device_type: str) -> Any:
    from lightning_par.core import dtypes

    pr = dtypes.precision(dtypes.canonical_precision(precision))
    if pr.compute != pr.param:  # mixed: autocast, as Lightning's MixedPrecision plugin
        return torch.autocast(device_type, dtype=pr.compute)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _hf_masks_as_for_real_tensors() -> Any:
    """transformers takes a fake tensor for a compile-time trace, where it cannot read values: it then
    assumes the position ids may hold packed sequences and materialises the causal mask (repeating
    grouped-query k/v for it), where real tensors get SDPA's ``is_causal`` and its native grouped-
    query attention -- the trace would hold a mask and k/v copies a real step never holds. A batch
    the model numbers itself (no position ids given, as ``HFCausalLM`` trains) is one sequence per
    row, so the trace tells transformers so for fake position ids."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor
        from transformers import masking_utils

        original = masking_utils.find_packed_sequence_indices
    except (ImportError, AttributeError):
        yield
        return

    def packed(position_ids: Any, *args: Any, **kwargs: Any) -> Any:
        return None if isinstance(position_ids, FakeTensor) else original(position_ids, *args, **kwargs)

    masking_utils.find_packed_sequence_indices = packed
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


class AdamW8bitBytes(torch.optim.Optimizer):
    """What torchao's ``AdamW8bit`` allocates, without its arithmetic: the trace's stand-in for it.

    The real step cannot run on fake tensors: torchao compiles its per-parameter update
    (``torch.compile(fullgraph=True)``) and calls the Inductor kernel, native code, with the tensors'
    data pointers, which fake tensors do not have: the step segfaults (issue 34; measured with torch
    2.13 and torchao 0.18 with the fake mode suspended, as ``core/optim.py``'s step suspended it, and
    under it once torchao's quantisation map is cached). On real tensors that step runs with every dispatch mode suspended, so MemTracker
    would not see its temporaries either.
    This stand-in allocates the same tensors as torchao 0.18 (``adam.py`` ``_new_buffer``,
    ``subclass_8bit.py`` ``OptimState8bit.zeros``) -- an fp32 scalar ``step``; per state of a
    parameter of >= 4096 elements that divides by the block, uint8 codes of the parameter's shape,
    one fp32 scale per block of 256 and a 256-entry fp32 map; smaller parameters' states in the
    parameter's dtype -- so the states the trace holds are torchao's to the byte (measured: 292,436
    bytes for the default ``hf_causal_lm``, what a training run of it reports). Its temporaries are
    the Inductor CPU kernel's (torch 2.13, measured from the generated code): per quantised
    parameter, one fp32 tensor of the parameter's size and one fp32 value per block for each state
    (the updated m and v and their blocks' absolute maxima before re-quantisation; amsgrad's third
    state assumed alike, not measured), freed before the next parameter; none for the others
    (updated in place). Parameters are left as they are: the trace measures memory, not values."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__([{"params": g["params"], "amsgrad": bool(g.get("amsgrad", False))}
                          for g in optimizer.param_groups], {})
        self.block_size = int(getattr(optimizer, "block_size", BLOCK_8BIT))

    def _quantised(self, p: torch.Tensor) -> bool:
        return p.numel() >= MIN_8BIT and p.numel() % self.block_size == 0

    def _state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self._quantised(p):
            return {"": torch.zeros_like(p)}
        return {"_codes": torch.zeros(p.shape, dtype=torch.uint8, device=p.device),
                "_scale": torch.zeros(p.numel() // self.block_size, device=p.device),
                "_qmap": torch.zeros(256, dtype=torch.float32, device=p.device)}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    for name in names:
                        state.update({name + key: t for key, t in self._state(p).items()})
                state["step"] += 1
                if self._quantised(p):
                    temporaries = [torch.empty(p.numel(), dtype=torch.float32, device=p.device) for _ in names]
                    temporaries += [torch.empty(p.numel() // self.block_size, device=p.device) for _ in names]
                    del temporaries
        return loss


def measurable_optimizer(optimizer: Any) -> Any:
    """``optimizer``, or the stand-in the trace runs instead where the real one cannot be traced
    (torchao's ``AdamW8bit``, ``lightning_par.core.optim``'s included: ``AdamW8bitBytes``)."""
    if "torchao.optim" not in sys.modules:  # torchao's optimizers import it: none of them can be this one
        return optimizer
    from torchao.optim import AdamW8bit

    return AdamW8bitBytes(optimizer) if isinstance(optimizer, AdamW8bit) else optimizer


def trace_model(make: Any, micro_batch: int, *, precision: str = "32-true", target: Any = None) -> TracedStep:
    """``trace_step`` of a fresh ``make()`` on fake tensors; where the model cannot run on fake tensors
    (its forward reads values: an MoE's dropless routing sizes each expert's batch from the router's
    choices, and kernels whose fake implementation is narrower than the real one), one real step at
    micro-batches 1 and 2 on the CPU, extrapolated linearly to ``micro_batch`` (activations and
    temporaries grow with the batch; parameters, gradients and states do not). The real fallback
    needs the model in host memory and measures the routing of its random initialisation."""
    # torch logs a kernel the fake run cannot do (e.g. grouped_mm's bf16-only meta kernel, what a
    # transformers MoE runs) as an ERROR with its traceback before raising; here that is the expected
    # way to the real fallback below, not an error the user should see
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        return trace_step(make(), micro_batch, precision=precision, target=target)
    except ValueError:
        raise
    except Exception:  # noqa: BLE001 - whatever the fake run could not do, the real one measures
        fake_log.setLevel(level)
        one, two = (trace_step(make(), b, precision=precision, target=target, fake=False) for b in (1, 2))
    finally:
        fake_log.setLevel(level)

    def grow(a: Moment, b: Moment) -> Moment:
        k = micro_batch - 1
        return replace(a, activations=max(0, a.activations + k * (b.activations - a.activations)),
                       temp=max(0, a.temp + k * (b.temp - a.temp)))

    return replace(one, backward=grow(one.backward, two.backward), step=grow(one.step, two.step),
                   micro_batch=micro_batch)


def _default_target(module: Any, x: torch.Tensor) -> torch.Tensor:
    """The loss's target for a batch ``x`` when none is given: a class index per sample for a classifier
    (``input_kind`` vectors or images), else the input itself (tokens: next-token prediction)."""
    from lightning_par.parallel.contract import input_kind_of

    if input_kind_of(module) in ("vectors", "images"):
        return torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    return x


def trace_step(module: Any, micro_batch: int, *, precision: str = "32-true", seq_len: int | None = None,
               target: Any = None, fake: bool = True) -> TracedStep:
    """Trace one training step of ``module`` (a LightningModule with lightning_par's model contract:
    ``configure_model``, ``example_input(batch, device)``, ``loss_fn(output, target)`` and
    ``configure_optimizers``) at ``micro_batch`` samples. ``target``: a function of the input giving
    the loss's target; without one, a classifier (``input_kind`` vectors or images: the MLP, the CNN)
    gets one class per sample, as its data gives it (the input itself is no class: the loss refused its
    shapes, so such a model was never traced), any other module the input itself (next-token style).
    ``fake=False``: on real CPU tensors (the reference, and ``trace_model``'s fallback). Raises
    ValueError when the module lacks the contract."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from lightning_par.core import dtypes
    from lightning_par.parallel.contract import example_input_of, loss_fn_of
    from lightning_par.parallel.discovery import resolve_plan

    example, loss_fn = example_input_of(module), loss_fn_of(module)
    if example is None or loss_fn is None:
        raise ValueError(f"{type(module).__name__} declares no example_input / loss_fn: its activations cannot be "
                         "traced (see lightning_par/parallel/contract.py)")
    if getattr(module, "pretrained", None):  # a checkpoint's weights do not change the memory: its config does
        module.pretrained = None
    pr = dtypes.precision(dtypes.canonical_precision(precision))
    mode: Any = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with mode, torch.device("cpu"):
        module.configure_model()
        if pr.param != torch.float32:  # bf16-true / 16-true: the module itself in that dtype
            module.to(pr.param)
        x = example(micro_batch, "cpu")
        y = target(x) if target is not None else _default_target(module, x)
        optimizers = module.configure_optimizers()
    opt = measurable_optimizer(optimizers["optimizer"] if isinstance(optimizers, dict) else (
        optimizers[0] if isinstance(optimizers, (list, tuple)) else optimizers))
    params = list(module.parameters())
    # the strategies' own block discovery (a declared plan, Hugging Face's no-split modules, repeated
    # children, sizes): the blocks the trace prices as FSDP units are the ones FSDP will make
    blocks = [module.get_submodule(b) for b in resolve_plan(module).plan.blocks]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    largest = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    root = sum(p.numel() for p in params if id(p) not in in_blocks)
    moments = []
    with mode, _hf_masks_as_for_real_tensors():
        tracker = MemTracker()  # forward and backward of a first step: no optimizer state exists yet
        _frozen_unhooked(tracker, module)
        tracker.track_external(module, opt)
        with tracker:
            with _precision_context(precision, "cpu"):
                loss = loss_fn(module(x), y)
            loss.backward()
        moments.append(Moment.of(tracker.get_tracker_snapshot("peak")))
        opt.step()  # creates the optimizer's states, which the next tracker registers as such
        tracker = MemTracker()
        _frozen_unhooked(tracker, module)
        tracker.track_external(module, opt)
        with tracker:  # a steady-state optimizer step: parameters, gradients, states and its temporaries
            opt.step()
            opt.zero_grad(set_to_none=True)
        moments.append(Moment.of(tracker.get_tracker_snapshot("peak")))
        held = Moment.of(tracker.get_tracker_snapshot("current")).optimizer_state  # the states alone, kept
    step = moments[1]  # its optimizer_state: the states and the step's temporaries (foreach Adam: one more)
    backward = replace(moments[0], optimizer_state=held)  # the states are held through every later step
    trains = lambda ps: sum(p.numel() for p in ps if p.requires_grad)  # noqa: E731 -- LoRA: the adapters only
    return TracedStep(backward, step, sum(p.numel() for p in params), dtypes.dtype_bytes(pr.param),
                      largest, root, micro_batch, seq_len, max((p.numel() for p in params), default=0),
                      trains(params), max((trains(b.parameters()) for b in blocks), default=0))


class _NoHook:
    def remove(self) -> None:
        pass


def _frozen_unhooked(tracker: Any, module: torch.nn.Module) -> None:
    """torch's ``MemTracker`` hooks every parameter's gradient, and ``register_hook`` refuses a parameter
    without one (a LoRA model's frozen base): mark those as hooked already (a frozen parameter never has a
    gradient to count)."""
    for p in module.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
