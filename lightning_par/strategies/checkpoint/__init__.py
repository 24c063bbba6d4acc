"""Checkpoints of the strategies: ``dcp`` (sharded save and load through torch.distributed.checkpoint),
``checksums`` (sha256 per file, verified before launch), ``errors`` (one-line save/load failures),
``lightning_file`` (Lightning's single-file checkpoints) and ``export`` (a checkpoint as a transformers directory)."""
