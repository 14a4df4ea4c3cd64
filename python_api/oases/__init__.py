"""Oases: overlapped tensor-parallel training for commodity GPU servers.

    oases.comm         ring all-gather / reduce-scatter / all-reduce from point-to-point ops
    oases.ops          fused, differentiable all_gather_linear / linear_reduce_scatter / linear_all_reduce
    oases.nn           ColumnParallelLinear / RowParallelLinear over those ops
    oases.parallelize  swap a model's nn.Linear layers for them, by plan or by naming scheme
    oases.schedule     megatron / merak / cross_pass / oases training schedules for TP stacks
    oases.models       a GPT whose stack trains on those schedules
"""
from oases import comm, models, ops, schedule
from oases.nn import parallelize  # also binds the subpackage oases.nn

__version__ = "0.1.0"
__all__ = ["comm", "ops", "nn", "parallelize", "schedule", "models", "__version__"]
