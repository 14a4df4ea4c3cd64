"""Tensor-parallel linear layers: thin modules over `oases.ops` and the mappings in `mappings`.

Megatron's pair (p ranks in `group`, r this rank; W [out, in], b [out] the unsharded nn.Linear's):

    ColumnParallelLinear   weight W[r-th block of rows]  [out/p, in]   bias b[r-th block]  [out/p]
    RowParallelLinear      weight W[:, r-th block]       [out, in/p]   bias b (replicated) [out]
    y = row(act(column(x)))  computes  F.linear(act(F.linear(x, W1, b1)), W2, b2)  of the unsharded
    model, with one reduction (row) per pair and each activation sharded on its features between.
    backward:  each parameter's .grad = the matching slice of the unsharded model's gradient
               gradient_accumulation_fusion=True:  weight.main_grad += dL/dweight (fp32), weight.grad None

Each mode's communication: each class's pseudo-code; the contracts: docs/guides/parallelize.md,
"The parallel layers in detail" (communication, gradients, fusion, Conv1D, init, blocks, replicas).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from oases.nn.column import ColumnParallelLinear
from oases.nn.experts import ParallelExperts
from oases.nn.row import RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "no_tp_communication"]


@contextlib.contextmanager
def no_tp_communication(module: nn.Module) -> Iterator[list[nn.Module]]:
    """Inside, the TP linears of `module` compute this rank's part and communicate nothing.

    ::

        ColumnParallelLinear:  y_r = F.linear(x, weight, bias)      # no all-reduce of grad_x
        RowParallelLinear:     z_r = F.linear(x_r, weight)          # partial sum, no reduce, no bias
        ParallelExperts:       its MoE block's z_r = block_r(x)     # no entry, no reduce (oases.nn._moe)

    so that  sum_r z_r + row.bias  is what the layers compute outside. The caller owns the
    reductions (as oases.schedule does: it all-reduces z and grad_x itself, asynchronously).
    Graphs recorded inside keep this meaning after the context exits (a column layer's `replicas`
    still sum their gradient: see the layers guide). Only for layers without sequence parallelism,
    gather_output or input splitting: those raise ValueError. Yields the layers it switched;
    restores each one's previous mode on exit.
    """
    layers = [m for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelExperts))]
    for m in layers:
        if (
            getattr(m, "sequence_parallel", False)
            or getattr(m, "gather_output", False)
            or not getattr(m, "input_is_parallel", True)
        ):
            raise ValueError(
                f"no_tp_communication: {m!r} communicates by its configuration (sequence_parallel, "
                "gather_output or input_is_parallel=False); only plain column/row layers can be "
                "run without communication"
            )
    previous = [m._communicate for m in layers]
    try:
        for m in layers:
            m._communicate = False
        yield layers
    finally:
        for m, mode in zip(layers, previous):
            m._communicate = mode
