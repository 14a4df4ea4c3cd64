"""all_gather_linear: all-gather the input along a sharded dimension, then nn.Linear.

fwd: ring all-gather of x, each piece's GEMM written into its slice of y while the next travels.
     Only this rank's shard x is saved for backward (as Megatron-LM does), not the p times larger
     gathered input.
bwd: dual: grad_x is a pipelined ring reduce-scatter of grad_y @ W. If W needs a gradient, x is
     gathered again by a second ring, posted first; after the reduce-scatter posts its i-th
     piece, the i-th gathered piece (own pieces first, then in arrival order) has its
     weight-gradient GEMM while both rings travel. Without a gradient for W there is no
     re-gather; without one for x, the re-gather alone, each piece's weight-gradient GEMM run
     while the next piece travels.
On CUDA every GEMM is cuBLAS, the forward's each into its piece's slice of y (Triton's
slice-writing kernel was slower on an H200: oases.ops.gemm). The rings run on
Oases' comm stream (oases.comm.ring): the compute stream waits only for the piece it reads next.

    forward, p=2, chunks=1 (rank 0):
      comm:  |--- x1 arrives ---|
      gemm:  | y0 = x0 W^T      | y1 = x1 W^T |
    backward, p=2, chunks=1 (rank 0):
      gemm:  | P1 = g1 W | dW += g0^T x0 | P0 = g0 W | + P0' | dW += g1^T x1 |
      comm:  |-- send x0, receive x1 --|
                         |---- send P1, receive P0' ----|
      grad_x0 = P0 + P0'
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from oases import _checks
from oases.comm.ring import all_gather_rows, reduce_scatter_rows
from oases.comm.topology import Ring, ring_of
from oases.costs.chunks import op_chunks
from oases.ops import gemm
from oases.ops._autocast import autocast_operands

__all__ = ["all_gather_linear"]


class _AllGatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, weight, bias, ring: Ring, dim: int, chunks: int, bidirectional: bool, main_grad: Optional[torch.Tensor]
    ):
        shard = x.movedim(dim, 0).contiguous()  # [n, ..., k]
        n = shard.shape[0]
        gathered = shard.new_empty((ring.size * n, *shard.shape[1:]))  # [p n, ..., k]
        y = shard.new_empty((ring.size * n, *shard.shape[1:-1], weight.shape[0]))  # [p n, ..., o]
        for rows in all_gather_rows(shard, gathered, ring, chunks, bidirectional):
            gemm.linear_into(gemm.rows2d(gathered[rows]), weight, bias, gemm.rows2d(y[rows]))
        # Only the weight gradient reads x: keep this rank's shard (the input itself), re-gathered
        # in backward; the gathered copy dies here.
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        ctx.ring, ctx.dim, ctx.chunks, ctx.bidirectional = ring, dim, chunks, bidirectional
        ctx.has_bias, ctx.main_grad = bias is not None, main_grad
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        ring, chunks, bidirectional = ctx.ring, ctx.chunks, ctx.bidirectional
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_y = grad_y.contiguous()  # [p n, ..., o]
        grad_b = gemm.rows2d(grad_y).sum(0) if ctx.has_bias and need_b else None
        main_grad = ctx.main_grad if need_w else None
        grad_w = gemm.weight_grad_buffer(weight) if need_w and main_grad is None else None
        arrived: Iterator[slice] = iter(())  # rows of the re-gathered x, as they become valid
        if need_w:
            shard = x.movedim(ctx.dim, 0).contiguous()  # [n, ..., k]
            gathered = shard.new_empty((ring.size * shard.shape[0], *shard.shape[1:]))  # [p n, ..., k]
            ring_pieces = all_gather_rows(shard, gathered, ring, chunks, bidirectional)
            # next() posts the gather's first ring step now, ahead of the reduce-scatter's pieces.
            arrived = itertools.chain([next(ring_pieces)], ring_pieces)

        def weight_grad(rows: slice) -> None:
            g, xs = gemm.rows2d(grad_y[rows]), gemm.rows2d(gathered[rows])
            if main_grad is not None:
                gemm.accumulate_main_grad(main_grad, g, xs)
            else:
                gemm.accumulate_weight_grad(grad_w, g, xs)

        grad_x = None
        if need_x:
            n = grad_y.shape[0] // ring.size
            grad_rows = grad_y.new_empty((n, *grad_y.shape[1:-1], weight.shape[1]))  # [n, ..., k]
            scattered = reduce_scatter_rows(
                lambda rows: torch.matmul(grad_y[rows], weight),
                grad_rows,
                ring,
                chunks,
                bidirectional,
            )
            for _ in scattered:  # this piece's partial sum is on the wire: one weight-gradient GEMM
                for rows in itertools.islice(arrived, 1):
                    weight_grad(rows)
            grad_x = grad_rows.movedim(0, ctx.dim)
        for rows in arrived:  # the rest, each while the next piece travels
            weight_grad(rows)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


@torch.compiler.disable  # one graph break under torch.compile, not one per ring step
def all_gather_linear(
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
    """Linear of the input gathered from every rank along `dim` (the column-parallel pattern).

        y = F.linear(cat([x from rank 0, ..., x from rank p-1], dim), weight, bias)
        # x [..., n, ..., k] (n at dim), weight [o, k], bias [o]  ->  y [..., p n, ..., o]

    Each of x's `chunks` pieces per rank is multiplied as soon as it arrives, while the next one
    travels, and written straight into its slice of y. `dim` may be any dimension but the last
    (the features); with dim != 0, y is a non-contiguous view. Differentiable: grad_x is reduced
    and scattered back to its owner, grad_weight and grad_bias are this rank's (exact, as `weight`
    is this rank's shard of the output features). Only x (not the gathered input) is kept for
    backward, which gathers it again if `weight` needs a gradient: one more all-gather of x per
    backward, overlapped with the grad_x reduce-scatter, for p times less saved activation.

    main_grad (fp32, weight's shape): backward adds weight's gradient into it in fp32
    (`main_grad += grad_w`, Megatron's gradient-accumulation fusion) and returns none for weight.
    """
    x, weight, bias, precision = autocast_operands(x, weight, bias)
    dim = _checks.sharded_linear("all_gather_linear", x, weight, bias, dim)
    ring = ring_of(group)
    row_elems = x.numel() // max(x.shape[dim] * x.shape[-1], 1)
    if chunks is None:  # Centauri's Algorithm 1 on default rates (oases.costs.chunks.op_chunks)
        chunks = op_chunks(
            ring.size * x.shape[dim] * row_elems,
            x.shape[-1],
            weight.shape[0],
            divides=x.shape[dim],
            comm_bytes=(ring.size - 1) * x.numel() * x.element_size(),
        )
    _checks.chunks_arg(chunks)
    _checks.divisible("x.shape[dim]", x.shape[dim], ring.size, chunks)
    gemm.check_main_grad(main_grad, weight)
    with precision, torch.profiler.record_function("oases::all_gather_linear"):
        y = _AllGatherLinear.apply(x, weight, bias, ring, dim, chunks, bidirectional, main_grad)
    return y.movedim(0, dim)
