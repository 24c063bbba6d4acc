"""Running a pipeline schedule (and loss-parallel TP) inside Lightning's training loop.

Lightning's automatic optimization runs, per batch, ``training_step`` -> ``zero_grad`` (first
batch of an accumulation window) -> ``backward``. A pipeline schedule runs forward *and* backward
of all micro-batches in one call, so here ``training_step`` runs the schedule and returns the
(detached) mean micro-batch loss, the same on every pipeline rank, which it also logs as
``train/loss``. The gradients it produced are set aside before Lightning's ``zero_grad`` and handed
back to the parameters in ``backward`` -- which runs no autograd of its own, only the hooks around
it -- so clipping, ``on_after_backward`` and the optimizer see them as usual. Loss scaling: torch's
schedule would divide *all* gradients by the number of micro-batches after every call (wrong under
gradient accumulation), so it is switched off and each micro-batch loss is scaled by
``1 / (n_microbatches * accumulate_grad_batches)`` instead. ``validation_step`` runs the
forward-only schedule and logs ``val/loss``.

With ``loss_parallel`` (tensor parallel), the strategy runs the forward and the model's
``loss_fn`` itself on vocabulary-sharded logits, inside torch's ``loss_parallel()`` context.

Gradient clipping uses the norm of the whole model's gradient (``parallel/sharding/gradients.py``).
``MeshParallelStrategy`` (``composite.py``) mixes this in; ``PipelineStrategy`` is its
pipeline-only preset.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_par.parallel.contract import loss_fn_of
from lightning_par.parallel.tensor.expert_parallel import average_replicated_gradients
from lightning_par.parallel.sharding.gradients import average_gradients, clip_grad_norm_
from lightning_par.parallel.pipeline.stage_ties import norm_excluded, sum_tied_gradients
from lightning_par.parallel.pipeline.schedule import Pipeline
from lightning_par.parallel.tensor.tensor_parallel import loss_parallel_context, reduce_partial_gradients


def pipeline_inputs(batch: Any, where: str, forward_kwargs: bool = False) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    dict[str, torch.Tensor]]:
    """The input, the target and the fields every stage's forward takes by keyword, of a batch the
    strategy runs itself (a pipeline schedule, loss-parallel TP): it calls the model's forward on the
    input and ``loss_fn(output, target)``, not the module's ``training_step``. A batch is an ``(input,
    target)`` pair of tensors; where the stages run a Hugging Face model's own forward
    (``forward_kwargs``), also a dict of ``input_ids``, ``labels`` and fields of the same batch size
    that forward takes by keyword (``attention_mask``, ``token_type_ids``, ``position_ids``, ...),
    which every stage receives for its micro-batch. Anything else would be dropped without a word:
    refused in one line."""
    if (isinstance(batch, (tuple, list)) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        return batch[0], batch[1], {}
    if forward_kwargs and isinstance(batch, dict) and {"input_ids", "labels"} <= set(batch):
        x, y = batch["input_ids"], batch["labels"]
        extras = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}
        bad = sorted(k for k, v in extras.items() if not isinstance(v, torch.Tensor) or v.shape[:1] != x.shape[:1])
        if bad or not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise ValueError(f"{where}: every field of a dict batch must be a tensor of the batch's size "
                             f"({x.shape[0] if isinstance(x, torch.Tensor) else '?'} rows); "
                             f"{', '.join(bad) or 'input_ids/labels'} {'is' if len(bad) < 2 else 'are'} not")
        return x, y, extras
    shape = (f"a dict with keys {sorted(batch)}" if isinstance(batch, dict) else
             f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) else
             f"a {type(batch).__name__}")
    dict_form = (", or a dict of input_ids, labels and fields the model's forward takes by keyword (attention_mask, "
                 "...)") if forward_kwargs else ""
    where_else = ("" if forward_kwargs else "masks and other fields reach a pipeline stage only for a Hugging Face "
                  "model; ")
    raise ValueError(f"{where} runs the model's forward on the input and loss_fn(output, target) itself, so a "
                     f"batch must be an (input, target) pair of tensors{dict_form}; got {shape} ({where_else}use a "
                     "data-parallel or sharded strategy for such a batch)")


def input_and_target(batch: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``pipeline_inputs`` for a strategy that passes nothing by keyword: an ``(input, target)`` pair."""
    x, y, _ = pipeline_inputs(batch, where)
    return x, y


class PipelineLoopMixin:
    """Lightning-loop plumbing for ``MeshParallelStrategy`` (see the module docstring)."""

    _pipeline: Pipeline | None = None
    _loss_scale: float = 1.0
    _pending_grads: list[tuple[nn.Parameter, torch.Tensor | None]] = []
    loss_parallel: bool = False

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn_of(self.lightning_module)(output, target) * self._loss_scale

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline_training_step(args[0], args[1])
        if self.loss_parallel:
            return self._loss_parallel_step(args[0], "train/loss")
        return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            x, y, extras = self._pipeline_inputs(args[0])
            with self.precision_plugin.val_step_context():
                loss = self._pipeline.eval_step(x, y, **extras) / self._loss_scale
            self.lightning_module.log("val/loss", loss, prog_bar=True, sync_dist=True)
            return loss
        if self.loss_parallel:
            return self._loss_parallel_step(args[0], "val/loss")
        return super().validation_step(*args, **kwargs)

    def _pipeline_inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        pipe = self._pipeline
        assert pipe is not None
        x, y, extras = pipeline_inputs(batch, "the pipeline", forward_kwargs=pipe.forward_keywords is not None)
        unknown = sorted(set(extras) - (pipe.forward_keywords or set()))
        if unknown and "*" not in (pipe.forward_keywords or set()):
            raise ValueError(f"the pipeline: the model's forward takes no {', '.join(unknown)} (batch fields a stage "
                             "passes to it by keyword)")
        return x, y, extras

    def _pipeline_training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        pipe, module = self._pipeline, self.lightning_module
        assert pipe is not None and module is not None
        x, y, extras = self._pipeline_inputs(batch)
        params = [p for p in module.parameters() if p.requires_grad]
        first = batch_idx % max(1, self.lightning_module.trainer.accumulate_grad_batches) == 0
        if first:  # last step's gradients: Lightning zeroes them right after this hook anyway
            for p in params:
                p.grad = None
        with self.precision_plugin.train_step_context():
            loss = pipe.step(x, y, **extras) / self._loss_scale  # forward + backward of every micro-batch
        if first:  # set aside from Lightning's zero_grad; backward() hands them back
            self._pending_grads = [(p, p.grad) for p in params]
            for p in params:
                p.grad = None
        module.log("train/loss", loss, prog_bar=True)
        return loss

    def _loss_parallel_step(self, batch: Any, name: str) -> torch.Tensor:
        """Forward, then the model's loss on vocabulary-sharded logits (no gather of the logits)."""
        module = self.lightning_module
        x, y = input_and_target(batch, "loss_parallel")
        context = self.precision_plugin.train_step_context() if name.startswith("train") \
            else self.precision_plugin.val_step_context()
        with context:
            out = module(x)
            with loss_parallel_context(True):
                loss = loss_fn_of(module)(out, y)
                if isinstance(loss, DTensor):
                    loss = loss.full_tensor()
        module.log(name, loss.detach(), prog_bar=True, sync_dist=name.startswith("val"))
        return loss

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if self._pipeline is not None:
            # the schedule already ran backward inside training_step: hand its gradients over
            for p, g in self._pending_grads:
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g
            self._pending_grads = []
            sum_tied_gradients(module, self._stage_ties)  # a shared weight's copies: the sum of both uses
        else:
            with loss_parallel_context(self.loss_parallel):
                self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        dims = self.parallel_dims
        if dims.ep > 1 and getattr(self, "data_parallel", "replicate") == "replicate":
            # experts and the rest are averaged over different groups (with fsdp, FSDP reduces both)
            average_replicated_gradients(module, self.device_mesh, self.data_mesh())
        elif dims.dp_replicate > 1:
            # averaging the whole accumulated gradient after every backward is exact: the part
            # averaged before is already equal on every replica
            average_gradients(module.parameters(), self.device_mesh["dp_replicate"].get_group())
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if getattr(self, "sequence_parallel", False):
            # the LayerNorms' Partial gradients, accumulated over micro-batches without communication,
            # are reduced once, after the step's last backward and before clipping or the optimizer
            # reads them (Lightning runs this closure only on the micro-batch that steps)
            module, inner = self.lightning_module, closure

            def closure() -> Any:
                out = inner()
                reduce_partial_gradients(module.parameters())
                return out

        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _use_global_norm_clipping(self) -> None:
        """Make Lightning's norm clipping (``gradient_clip_val``) use the whole model's norm. Lightning
        calls the precision plugin's ``clip_grad_by_norm``; this strategy owns that plugin instance."""
        pp_group = self.device_mesh["pp"].get_group() if self.parallel_dims.pp > 1 else None
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            clip_grad_norm_(plugin.main_params(optimizer), clip_val, pp_group=pp_group,
                            norm_excluded=norm_excluded(self.lightning_module, self._stage_ties))

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    @override
    def teardown(self) -> None:
        self._pipeline = None
        self._pending_grads = []
        super().teardown()

