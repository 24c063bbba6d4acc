"""Building on the meta device and materialising only each rank's shards: ``materialize`` (init groups),
``init_trace`` (where constructor tensors came from), ``ties`` (tied parameters) and ``weights`` (pretrained
safetensors read slice by slice)."""
