"""Pipeline parallelism: cutting a model into stages (``stages``), the schedules over torch.distributed.pipelining
(``schedule``) and parameters shared between stages (``stage_ties``). Model-specific stage runners come from the
resolved plan (``ParallelPlan.stage_runner``), never from an import of ``parallel/hf``."""
