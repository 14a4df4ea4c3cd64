"""Fused, differentiable communication + linear ops (nn.Linear semantics: y = x @ W.T + b).

::

    all_gather_linear(x, W, b)      = F.linear(all_gather(x, dim), W, b)          column-parallel
    linear_reduce_scatter(x, W, b)  = reduce_scatter(F.linear(x, W), dim) + b     row-parallel, SP
    linear_all_reduce(x, W, b)      = all_reduce(F.linear(x, W)) + b              row-parallel
    linear_unread(x, W)             F.linear(x, W)'s graph, its value left out (no forward GEMM):
                                    for a graph only differentiated (fine-grained recomputation)

`oases.ops.reference` holds the plain (blocking collective, then GEMM) versions; F.linear is
linear_unread's. `oases.ops.gemm` is their compute side (GEMMs into output slices, weight-gradient
accumulation), which the layers' gradient-accumulation fusion uses too.
"""

from oases.ops import reference
from oases.ops.all_gather_linear import all_gather_linear
from oases.ops.linear_all_reduce import linear_all_reduce
from oases.ops.linear_reduce_scatter import linear_reduce_scatter
from oases.ops.linear_unread import linear_unread

__all__ = ["all_gather_linear", "linear_reduce_scatter", "linear_all_reduce", "linear_unread", "reference"]
