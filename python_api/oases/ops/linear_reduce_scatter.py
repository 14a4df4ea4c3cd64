"""linear_reduce_scatter: nn.Linear on a feature shard, then reduce-scatter along a dimension.

fwd: each block's partial product is computed just before it is sent; the partial sum received
     from the previous rank is added to it (ring reduce-scatter), bias added once at the end.
bwd: dual: ring all-gather of grad_y, each piece's grad_x and weight-gradient GEMMs run while the
     next piece travels.
GEMMs are cuBLAS (torch.mm) on CUDA: each block's product is computed on the compute stream
before the partial sum it extends is waited for; the wait and the add run on Oases' comm stream
(oases.comm.ring), so no GEMM queues behind a transfer.

    forward, p=2, chunks=1 (rank 0):
      gemm:  | P1 = x[1] W^T | P0 = x[0] W^T |
      comm:                  |-- send P1, receive P0' --|
      y0 = P0 + P0' + b
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from oases import _checks
from oases._ranges import hot_range
from oases.comm.ring import all_gather_rows, reduce_scatter_rows
from oases.comm.topology import Ring, ring_of
from oases.costs.chunks import op_chunks
from oases.ops import gemm
from oases.ops._autocast import autocast_operands

__all__ = ["linear_reduce_scatter"]


class _LinearReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, weight, bias, ring: Ring, dim: int, chunks: int, bidirectional: bool, main_grad: Optional[torch.Tensor]
    ):
        rows = x.movedim(dim, 0).contiguous()  # [p n, ..., k]
        n = rows.shape[0] // ring.size
        y = rows.new_empty((n, *rows.shape[1:-1], weight.shape[0]))  # [n, ..., o]

        def partial(r: slice) -> torch.Tensor:  # this rank's partial sum of one piece, [rows, ..., o]
            with hot_range("oases::gemm"):
                return F.linear(rows[r], weight)

        for _ in reduce_scatter_rows(partial, y, ring, chunks, bidirectional):
            pass
        if bias is not None:
            y.add_(bias)
        ctx.save_for_backward(rows, weight)
        ctx.ring, ctx.dim, ctx.chunks, ctx.bidirectional = ring, dim, chunks, bidirectional
        ctx.has_bias, ctx.main_grad = bias is not None, main_grad
        return y

    @staticmethod
    def backward(ctx, grad_y):
        rows, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_y = grad_y.contiguous()  # [n, ..., o]
        grad_b = gemm.rows2d(grad_y).sum(0) if ctx.has_bias and need_b else None
        main_grad = ctx.main_grad if need_w else None
        grad_w = gemm.weight_grad_buffer(weight) if need_w and main_grad is None else None
        grad_x = torch.empty_like(rows) if need_x else None  # [p n, ..., k]
        if need_x or need_w:
            gathered = grad_y.new_empty((rows.shape[0], *grad_y.shape[1:]))  # [p n, ..., o]
            for r in all_gather_rows(grad_y, gathered, ctx.ring, ctx.chunks, ctx.bidirectional):
                g = gemm.rows2d(gathered[r])
                if need_x:
                    torch.mm(g, weight, out=gemm.rows2d(grad_x[r]))
                if main_grad is not None:
                    gemm.accumulate_main_grad(main_grad, g, gemm.rows2d(rows[r]))
                elif need_w:
                    gemm.accumulate_weight_grad(grad_w, g, gemm.rows2d(rows[r]))
        if grad_x is not None:
            grad_x = grad_x.movedim(0, ctx.dim)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


@torch.compiler.disable  # one graph break under torch.compile, not one per ring step
def linear_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
    *,
    dim: int = 0,
    chunks: Optional[int] = None,
    bidirectional: bool = False,
    main_grad: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reduce-scatter of a feature-sharded linear (the sequence-parallel row-parallel pattern).

        n = x.shape[dim] // p
        y = sum(F.linear(x, weight) from every rank).narrow(dim, rank * n, n) + bias
        # x [..., p n, ..., k] (k: this rank's input features), weight [o, k]  ->  y [..., n, ..., o]

    Each partial product is computed while the previous one travels, and the partial sum
    received is accumulated into it. The bias is added once, after the reduction. grad_bias is
    this rank's contribution (sum over ranks for the gradient of a shared bias).

    main_grad (fp32, weight's shape): backward adds weight's gradient into it in fp32
    (`main_grad += grad_w`, Megatron's gradient-accumulation fusion) and returns none for weight.
    """
    x, weight, bias, precision = autocast_operands(x, weight, bias)
    dim = _checks.sharded_linear("linear_reduce_scatter", x, weight, bias, dim)
    ring = ring_of(group)
    row_elems = x.numel() // max(x.shape[dim] * x.shape[-1], 1)
    if chunks is None and x.shape[dim] % ring.size == 0:  # Centauri's Algorithm 1 (oases.costs.chunks)
        chunks = op_chunks(
            x.shape[dim] * row_elems,
            x.shape[-1],
            weight.shape[0],
            divides=x.shape[dim] // ring.size,
            comm_bytes=(ring.size - 1) / ring.size * x.numel() // x.shape[-1] * weight.shape[0] * x.element_size(),
        )
    chunks = 1 if chunks is None else chunks
    _checks.chunks_arg(chunks)
    _checks.full_divisible("x.shape[dim]", x.shape[dim], ring.size, chunks)
    gemm.check_main_grad(main_grad, weight)
    with precision, torch.profiler.record_function("oases::linear_reduce_scatter"):
        y = _LinearReduceScatter.apply(x, weight, bias, ring, dim, chunks, bidirectional, main_grad)
    return y.movedim(0, dim)
