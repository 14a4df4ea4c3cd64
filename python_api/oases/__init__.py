"""Oases: overlapped tensor-parallel training for commodity GPU servers.

    oases.comm   ring all-gather / reduce-scatter / all-reduce from point-to-point ops
    oases.ops    fused, differentiable all_gather_linear / linear_reduce_scatter / linear_all_reduce
"""
from oases import comm, ops

__version__ = "0.1.0"
__all__ = ["comm", "ops", "__version__"]
