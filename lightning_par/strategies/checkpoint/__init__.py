"""Checkpoints of the strategies: ``dcp`` (sharded save and load through torch.distributed.checkpoint),
``checksums`` (sha256 per file, verified before launch), ``errors`` (one-line save/load failures),
``lightning_file`` (Lightning's single-file checkpoints), ``export`` (a checkpoint as a transformers directory) and
``lora_export`` (a LoRA run's export: merged, or a PEFT adapter)."""
