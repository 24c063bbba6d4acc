"""Techniques that split single layers: tensor parallelism over DTensor (``tensor_parallel``, its styles
in ``tp_styles``) and expert parallelism (``expert_parallel``: routed experts sharded over an ep axis)."""
