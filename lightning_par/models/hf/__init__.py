"""Hugging Face models as LightningModules: ``causal_lm`` (HFCausalLM), ``pretrained`` (``from_pretrained``
filled shard by shard under a strategy) and ``registry`` (the causal-LM families walked from transformers' own registry)."""
