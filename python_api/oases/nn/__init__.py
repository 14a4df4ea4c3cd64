"""Tensor-parallel modules over `oases.ops`, and `parallelize` to shard an existing model.

    ColumnParallelLinear   output features sharded (weight [out/p, in])
    RowParallelLinear      input features sharded, output reduced (weight [out, in/p])
    parallelize(model)     nn.Linear -> the layers above, in place, by a plan of name patterns

The communication mappings the layers use (copy/reduce, split/gather) are in `oases.nn._mappings`.
"""
from oases.nn.layers import ColumnParallelLinear, RowParallelLinear
from oases.nn.parallelize import DEFAULT_PLAN, parallelize

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "parallelize", "DEFAULT_PLAN"]
