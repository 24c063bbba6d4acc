"""Pipeline parallelism on ``torch.distributed.pipelining``: cut a model into stages, give each rank
its stages, run a schedule, and time every stage's compute so the bubble can be measured.

A model declares ``layers``: module paths that, applied one after another, compute its forward
(each maps one tensor to one tensor). A Hugging Face model is the exception: its layers take masks
and rotary tables its forward builds, so each of its stages runs that forward itself
(``hf.stages.HFStageRunner``), cut at the same paths. ``balance_layers`` cuts that list into
contiguous groups
minimizing the most expensive group; ``build_stage_modules`` wraps each group in a
``PipelineStageModule`` that keeps the original modules under their original dotted paths, so a
stage's ``state_dict`` keys *are* the full model's FQNs (checkpoints need no renaming).

Stage placement (``stage_indices_for_rank``): one stage per rank for ``gpipe``/``1f1b``; loop
style for ``interleaved_1f1b``/``zb`` (rank r owns stages r, r+p, ..., r+(v-1)p); V shape for
``zbv`` (rank r owns stages r and 2p-1-r, so the first and last stage share rank 0).

Loss: ``loss_fn(output, target)`` is a mean over one micro-batch; torch's schedule divides the
accumulated gradients by the number of micro-batches (``scale_grads=True``) and hands back the
per-micro-batch losses in ``losses=[]``; with equal micro-batches their mean is the full-batch
mean, i.e. the single-device loss. ``Pipeline.step`` returns that mean on every pipeline rank.

Bubble: ``TimedPipelineStage`` records ``(stage, kind, micro-batch, start, end)`` for every
forward (``F``), full backward (``B``), input-only backward (``I``), weight backward (``W``) and
loss (``L``) in a ``StageTimer``, read off its clock (``time.perf_counter`` unless
``build_schedule`` is given another, e.g. a test's deterministic one), as are the start and end of
every schedule call; ``bubble_stats`` turns them into busy time vs. step wall time. Idle time
includes waiting on communication, which is what a bubble costs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from lightning_par.parallel.contract import aux_loss_sources, forward_stats_sources
from lightning_par.parallel.contract import StageRunnerFactory

log = logging.getLogger(__name__)

SCHEDULES = {
    "gpipe": ScheduleGPipe,  # all forwards, then all backwards
    "1f1b": Schedule1F1B,  # warm-up forwards, then one forward one backward, then cool-down
    "interleaved_1f1b": ScheduleInterleaved1F1B,  # 1F1B over v loop-placed stages per rank
    "zb": ScheduleInterleavedZeroBubble,  # backward split into input (I) and weight (W) grads
    "zbv": ScheduleZBVZeroBubble,  # zero bubble, two V-placed stages per rank
}
MULTI_STAGE = ("interleaved_1f1b", "zb", "zbv")
ONE_F_ONE_B = ("1f1b", "interleaved_1f1b", "zb", "zbv")


# ---------------------------------------------------------------------------------------------
# Cutting the model


def balance_layers(costs: Sequence[float], n_stages: int, starts: Sequence[int] = ()) -> list[int]:
    """Cut ``costs`` into ``n_stages`` contiguous non-empty groups minimizing the largest group sum.

    Returns the boundaries ``[0, b_1, ..., len(costs)]``: stage s holds layers ``b_s .. b_{s+1}-1``.
    Among optimal cuts it returns the one packing each stage as full as possible from the front.
    ``starts`` (``ParallelPlan.stage_starts``; () = any layer): the only layers a stage may begin at;
    the layers from one start to the next are then balanced as one.
    """
    if starts:
        edges = [*sorted(starts), len(costs)]
        grouped = [float(sum(costs[a:b])) for a, b in zip(edges, edges[1:])]
        try:
            bounds = balance_layers(grouped, n_stages)
        except ValueError:
            raise ValueError(f"cannot cut {len(costs)} layers into {n_stages} pipeline stages: a stage may start "
                             f"at only {len(grouped)} of them (the model's stage_starts)") from None
        return [edges[b] for b in bounds]
    n = len(costs)
    if n_stages < 1:
        raise ValueError(f"number of pipeline stages must be at least 1, got {n_stages}")
    if n < n_stages:
        raise ValueError(f"cannot cut {n} layers into {n_stages} pipeline stages; "
                         f"need at least one layer per stage")
    if any(c < 0 for c in costs):
        raise ValueError("layer costs must be non-negative")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest possible max group cost splitting the first i layers into k groups
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            best[k][i] = min(max(best[k - 1][j], prefix[i] - prefix[j]) for j in range(k - 1, i))
    limit = best[n_stages][n] * (1 + 1e-12)
    # greedy front packing under the optimal limit, leaving one layer for every later stage
    bounds, start = [0], 0
    for s in range(n_stages - 1):
        end = start + 1
        while end < n - (n_stages - s - 1) and prefix[end + 1] - prefix[start] <= limit:
            end += 1
        bounds.append(end)
        start = end
    bounds.append(n)
    return bounds


def layer_costs_by_params(model: nn.Module, layers: Sequence[str]) -> list[float]:
    """Parameter count of every layer: balances memory. Embedding tables are lookups (memory, little
    compute), so to balance compute pass your own costs (e.g. FLOPs) to ``balance_layers``."""
    return [float(sum(p.numel() for p in model.get_submodule(path).parameters())) for path in layers]


class PipelineStageModule(nn.Module):
    """Runs a contiguous group of a model's layers in order.

    The original modules are registered under their original dotted paths (through empty
    container modules), so ``named_parameters()``/``state_dict()`` of a stage use the full model's
    FQNs; ``fqns`` lists them. Layers are looked up by path at every call, so wrapping one later
    (activation checkpointing, ``fully_shard``) is picked up. With a ``runner`` (from the plan's
    ``stage_runner``: a Hugging Face model's ``HFStageRunner``) the stage runs the model's own forward over
    its layers instead of calling them one after another.
    """

    def __init__(self, model: nn.Module, layers: Sequence[str], stage_index: int,
                 runner: Callable[..., torch.Tensor] | None = None) -> None:
        super().__init__()
        self.layers = tuple(layers)
        self.stage_index = stage_index
        self.runner = runner
        for path in self.layers:
            parent: nn.Module = self
            *heads, leaf = path.split(".")
            for name in heads:
                if name not in parent._modules:
                    parent.add_module(name, nn.Module())
                parent = parent._modules[name]  # type: ignore[assignment]
            parent.add_module(leaf, model.get_submodule(path))

    @property
    def fqns(self) -> list[str]:
        """Names of this stage's parameters, identical to their names in the full model."""
        return [name for name, _ in self.named_parameters()]

    def forward(self, x: torch.Tensor, **forward_kwargs: Any) -> torch.Tensor:
        if self.runner is not None:  # the batch's fields for the model's own forward (a padding mask, ...)
            return self.runner(x, self.get_submodule, **forward_kwargs)
        if forward_kwargs:
            raise TypeError(f"pipeline stage {self.stage_index}: layers called one after another take no keyword "
                            f"inputs ({', '.join(forward_kwargs)})")
        for path in self.layers:
            x = self.get_submodule(path)(x)
        return x

    def extra_repr(self) -> str:
        return f"stage={self.stage_index}, layers={list(self.layers)}"


def build_stage_modules(model: nn.Module, *, layers: Sequence[str], boundaries: Sequence[int],
                        stage_indices: Sequence[int],
                        stage_runner: StageRunnerFactory | None = None) -> list[PipelineStageModule]:
    """Stage modules for ``stage_indices`` (this rank's stages), sharing the modules of ``model``.

    ``layers`` must cover every parameter of ``model`` (each parameter in exactly one layer). When
    they all lie inside a Hugging Face model, each stage runs that model's own forward.
    """
    layers = list(layers)
    for a in layers:
        for b in layers:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"pipeline layers overlap: {b!r} lies inside {a!r}")
    if len(set(layers)) != len(layers):
        raise ValueError("pipeline layers contain a duplicate path")
    covered = {name for path in layers for name, _ in model.get_submodule(path).named_parameters(prefix=path)}
    missing = [name for name, _ in model.named_parameters() if name not in covered]
    if missing:
        raise ValueError(f"parameter {missing[0]!r} belongs to no pipeline layer; "
                         "the model's layers must cover all its parameters")
    b = list(boundaries)
    if b[0] != 0 or b[-1] != len(layers) or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(f"bad stage boundaries {b} for {len(layers)} layers")
    run = stage_runner or (lambda *_: None)
    return [PipelineStageModule(model, layers[b[s]:b[s + 1]], s, run(model, layers, b[s], b[s + 1]))
            for s in stage_indices]


# ---------------------------------------------------------------------------------------------
# Placement and validation


def stage_indices_for_rank(schedule: str, pp_rank: int, pp_size: int, virtual_stages: int = 1) -> list[int]:
    """The stages a pipeline rank owns: loop layout, or V layout for ``zbv``."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + i * pp_size for i in range(virtual_stages)]


def validate_pipeline(schedule: str, *, pp_size: int, n_microbatches: int, virtual_stages: int = 1,
                      n_layers: int | None = None, of_layers: int | None = None) -> int:
    """Check a pipeline configuration; returns the total number of stages. One-line ``ValueError``s.
    ``n_layers``: the places a stage may start; ``of_layers``: the model's layers, when that differs
    (``ParallelPlan.stage_starts``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if virtual_stages < 1 or n_microbatches < 1 or pp_size < 1:
        raise ValueError("pipeline sizes (pp, n_microbatches, virtual_stages) must be positive")
    if schedule == "zbv" and virtual_stages != 2:
        raise ValueError(f"schedule zbv runs exactly 2 stages per rank, got virtual_stages={virtual_stages}")
    if schedule not in MULTI_STAGE and virtual_stages != 1:
        raise ValueError(f"schedule {schedule} runs one stage per rank, got virtual_stages={virtual_stages}; "
                         "use interleaved_1f1b for virtual stages")
    if schedule in ONE_F_ONE_B and n_microbatches < pp_size:
        raise ValueError(f"schedule {schedule} needs n_microbatches >= pipeline stages per step "
                         f"(pp={pp_size}), got n_microbatches={n_microbatches}")
    rounds = max(1, n_microbatches // pp_size)
    if schedule in ("interleaved_1f1b", "zb") and n_microbatches % rounds:
        raise ValueError(f"schedule {schedule} needs n_microbatches to be a multiple of "
                         f"n_microbatches // pp = {rounds}, got n_microbatches={n_microbatches}")
    n_stages = pp_size * virtual_stages
    if n_layers is not None and n_layers < n_stages:
        where = (f"{of_layers} layers, of which a stage may start at only {n_layers}," if of_layers not in (None, n_layers)
                 else f"{n_layers} layers")
        raise ValueError(f"cannot cut {where} into {n_stages} pipeline stages "
                         f"(pp={pp_size} x virtual_stages={virtual_stages})")
    return n_stages


def theoretical_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step predicted with equal per-stage times and free communication.

    - ``gpipe``/``1f1b``: ``(p-1)/(m+p-1)`` (GPipe, Huang et al. 2019; the bubble is ``(p-1)/m`` of the
      ideal time, Narayanan et al. 2021 "Efficient Large-Scale Language Model Training on GPU
      Clusters Using Megatron-LM", sec. 2.2; as a fraction of the whole step it is the above).
    - ``interleaved_1f1b``: ``(p-1)/(v*m+p-1)`` (same paper, sec. 2.2.2: v model chunks per rank
      shrink the bubble v times).
    - ``zb``: ``(p-1)/(3*v*m+p-1)``: ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism")
      leaves a third of the 1F1B bubble when forward, input-backward and weight-backward take equal
      time; an estimate, extended to v chunks like interleaving.
    - ``zbv``: ``0.0``: ZB-V's ideal (same paper, sec. 6) for equal F/I/W times and m >= 2p.
    """
    if p < 1 or m < 1 or v < 1:
        raise ValueError("theoretical_bubble needs positive p, m, v")
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb":
        return (p - 1) / (3 * v * m + p - 1)
    if schedule == "zbv":
        return 0.0
    raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")


# ---------------------------------------------------------------------------------------------
# Timing


class StageEvent(NamedTuple):
    stage: int
    kind: str  # F forward, B full backward, I input backward, W weight backward, L loss
    microbatch: int
    start: float  # seconds on the timer's clock
    end: float


@dataclass
class StageTimer:
    """Collects the compute events of this rank's stages and the wall time of the last step, read off
    ``clock`` (seconds; ``time.perf_counter`` unless one is injected)."""

    events: list[StageEvent] = field(default_factory=list)
    step_start: float = 0.0
    step_end: float = 0.0
    clock: Callable[[], float] = time.perf_counter

    @contextlib.contextmanager
    def record(self, stage: int, kind: str, microbatch: int) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.events.append(StageEvent(stage, kind, microbatch, start, self.clock()))

    def begin_step(self) -> None:
        self.events.clear()
        self.step_start = self.clock()

    def end_step(self) -> None:
        self.step_end = self.clock()


def bubble_stats(events: Sequence[StageEvent], step_start: float, step_end: float) -> dict:
    """Busy time of this rank's stages vs. the step's wall time.

    Returns ``wall_s``, ``busy_s`` (sum of event durations), ``bubble`` (``1 - busy/wall``, the
    rank's idle fraction) and ``per_stage`` (stage index -> busy seconds).
    """
    wall = max(step_end - step_start, 1e-12)
    per_stage: dict[int, float] = {}
    for e in events:
        per_stage[e.stage] = per_stage.get(e.stage, 0.0) + (e.end - e.start)
    busy = sum(per_stage.values())
    return {"wall_s": wall, "busy_s": busy, "bubble": max(0.0, 1.0 - busy / wall), "per_stage": per_stage}


class TimedPipelineStage(PipelineStage):
    """A ``PipelineStage`` that records every compute action in a ``StageTimer``. The schedules
    wait for their receives before calling these methods, so the events hold compute only."""

    def __init__(self, *args, timer: StageTimer, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.timer = timer

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):  # type: ignore[override]
        with self.timer.record(self.stage_index, "F", fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_one_chunk(  # type: ignore[override]
        self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False
    ):
        with self.timer.record(self.stage_index, "B" if full_backward else "I", bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):  # type: ignore[override]
        with self.timer.record(self.stage_index, "W", bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    # torch 2.13's runtime still hands gradients between two stages of one rank (V placement) when
    # the schedule runs forward-only (``schedule.eval``) and then asserts; nothing to hand over there.
    def get_local_bwd_output(self, mb_index):  # type: ignore[override]
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):  # type: ignore[override]
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


# ---------------------------------------------------------------------------------------------
# Schedule


@dataclass
class Pipeline:
    """This rank's part of a pipeline: its stage modules, torch stages, the schedule and a timer."""

    schedule: object  # a torch.distributed.pipelining schedule
    schedule_name: str
    modules: list[PipelineStageModule]
    stages: list[TimedPipelineStage]
    timer: StageTimer
    n_microbatches: int
    n_stages: int
    group: dist.ProcessGroup | None

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    @property
    def forward_keywords(self) -> set[str] | None:
        """The names the stages' model forward takes by keyword (``"*"``: any), None where the stages call
        their layers one after another (no keyword inputs): what a batch may carry beside input and target."""
        runners = [m.runner for m in self.modules]
        if not runners or any(r is None for r in runners):
            return None
        return runners[0].forward_keywords()

    def parameters(self) -> Iterator[nn.Parameter]:
        for m in self.modules:
            yield from m.parameters()

    def _run(self, fn: Callable, x: torch.Tensor | None, target: torch.Tensor | None,
             forward_kwargs: dict[str, torch.Tensor]) -> torch.Tensor:
        for t in (x, target, *forward_kwargs.values()):
            if t is not None and t.shape[0] % self.n_microbatches:
                raise ValueError(f"pipeline batch size {t.shape[0]} is not divisible by "
                                 f"n_microbatches={self.n_microbatches}")
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first and x is not None else ()
        aux = aux_loss_sources(self.modules)
        stats = forward_stats_sources(self.modules)  # the aux-loss layers among them
        for m in stats:
            m.clear_stats()
        self.timer.begin_step()
        # the batch's keyword fields go to every stage (torch's schedules split them into micro-batches and pass
        # each stage its own), the input to the first and the target to the last
        fn(*args, target=target if self.has_last else None, losses=losses, **forward_kwargs)
        self.timer.end_step()
        for m in stats:  # each of this rank's stages ran one forward per micro-batch (+ shape inference once)
            m.keep_last_forwards(self.n_microbatches)
        loss = torch.stack([l.detach() for l in losses]).mean() if losses else torch.zeros(())
        loss = loss.to(self.stages[0].device).float()
        # the auxiliary losses of this rank's layers (their mean over the micro-batches, in the scaled
        # losses' units): the sum over the pipeline's ranks is then the loss the single device returns
        sums = [m.aux_sum * m.aux_grad_scale / self.n_microbatches for m in aux if m.aux_sum is not None]
        if sums:
            loss = loss + torch.stack(sums).sum().to(loss)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(loss, group=self.group)  # only the last stage's rank contributes
        return loss

    def scale_aux_losses(self, scale: float) -> None:
        """Let every auxiliary-loss layer of this rank's stages (``AuxLossSource``) feed its loss into
        backward scaled like a micro-batch's loss (``loss_fn``'s ``scale``): no stage returns it."""
        for m in aux_loss_sources(self.modules):
            m.aux_grad_scale = scale

    def step(self, x: torch.Tensor | None, target: torch.Tensor | None, **forward_kwargs: torch.Tensor) -> torch.Tensor:
        """Forward + backward of one batch (gradients accumulate in the stage modules); returns the
        mean micro-batch loss (plus the stages' auxiliary losses), the same on every pipeline rank.
        ``forward_kwargs``: batch fields every stage's model forward takes by keyword (``forward_keywords``)."""
        return self._run(self.schedule.step, x, target, forward_kwargs)  # type: ignore[attr-defined]

    def eval_step(self, x: torch.Tensor | None, target: torch.Tensor | None,
                  **forward_kwargs: torch.Tensor) -> torch.Tensor:
        """Forward only; returns the mean micro-batch loss on every pipeline rank."""
        with torch.no_grad():
            return self._run(self.schedule.eval, x, target, forward_kwargs)  # type: ignore[attr-defined]


def _group_of(pp_group: DeviceMesh | dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if isinstance(pp_group, DeviceMesh):
        if pp_group.ndim != 1:
            raise ValueError(f"pipeline needs a 1-D pp mesh, got {pp_group.ndim}-D; pass mesh['pp']")
        return pp_group.get_group()
    return pp_group


def build_schedule(
    modules: Sequence[nn.Module],
    *,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    pp_group: DeviceMesh | dist.ProcessGroup | None = None,
    virtual_stages: int = 1,
    stage_indices: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Pipeline:
    """Wrap this rank's stage modules in pipeline stages and build the schedule.

    Args:
        modules: this rank's stage modules, in the order of ``stage_indices``.
        schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zb`` or ``zbv``.
        loss_fn: ``loss_fn(output, target)``, a mean over one micro-batch.
        pp_group: the pipeline axis (1-D mesh or process group); default: the world.
        stage_indices: defaults to ``stage_indices_for_rank`` of this rank.
        clock: what the pipeline's ``StageTimer`` reads its times from (seconds).
    """
    group = _group_of(pp_group)
    pp_size = dist.get_world_size(group)
    pp_rank = dist.get_rank(group)
    n_stages = validate_pipeline(schedule, pp_size=pp_size, n_microbatches=n_microbatches,
                                 virtual_stages=virtual_stages)
    indices = list(stage_indices) if stage_indices is not None else stage_indices_for_rank(
        schedule, pp_rank, pp_size, virtual_stages)
    if len(indices) != len(modules):
        raise ValueError(f"got {len(modules)} stage modules for stages {indices} of pipeline rank {pp_rank}")
    if device is None:
        device = next((p.device for m in modules for p in m.parameters()), torch.device("cpu"))
    timer = StageTimer(clock=clock)
    last = n_stages - 1

    def timed_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with timer.record(last, "L", -1):
            return loss_fn(output, target)

    stages = [TimedPipelineStage(m, i, n_stages, torch.device(device), group=group, timer=timer)
              for m, i in zip(modules, indices)]
    cls = SCHEDULES[schedule]
    if schedule in MULTI_STAGE:
        sched = cls(stages, n_microbatches=n_microbatches, loss_fn=timed_loss, scale_grads=True)
    else:
        sched = cls(stages[0], n_microbatches=n_microbatches, loss_fn=timed_loss, scale_grads=True)
    log.info("pipeline: %s, pp=%d, stages %s of %d on rank %d, %d micro-batches", schedule, pp_size, indices,
             n_stages, pp_rank, n_microbatches)
    return Pipeline(sched, schedule, list(modules), stages, timer, n_microbatches, n_stages, group)

