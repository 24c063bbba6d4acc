"""Hugging Face specifics, reached inside ``parallel/`` only through ``discovery.py``: plans derived from a
model's config and classes (``plan``, ``tp_derive``, ``tp_verified``, ``pp_derive``), its pipeline stage runner
(``stages``), its expert modules (``experts``), FLOP counting (``flops``), sharded ``save_pretrained`` (``save``)
and transformers' ``from_pretrained`` under a strategy (``from_pretrained``)."""
