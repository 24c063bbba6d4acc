"""Layer 1: plain-torch functions that apply one parallelism technique to an ``nn.Module``.

Nothing here imports Lightning; everything is testable with a bare process group.
"""
