"""linear_all_reduce: nn.Linear on a feature shard, then all-reduce (the row-parallel pattern).

fwd: the rows are cut into `chunks` pieces; each piece's all-reduce is started asynchronously
     (the backend's own: NCCL's stream, gloo's threads) as soon as its GEMM is done, and runs
     while the next pieces' GEMMs compute.
bwd: dual: identity for the all-reduce, so grad_x = grad_y @ W locally, with no communication.
GEMMs are cuBLAS (torch.mm into each piece's rows) on CUDA; each piece's all-reduce runs on the
process group's NCCL stream, which waits (by event) for the compute stream at the moment the
all-reduce is issued, that is for this piece's GEMM, and the compute stream waits for the
all-reduces only before the bias add.

    forward, p=2, chunks=3:
      gemm: | Y0 = X0 W^T | Y1 = X1 W^T | Y2 = X2 W^T |
      comm:               |-- AR(Y0) ---|-- AR(Y1) ---|-- AR(Y2) --|

Why not oases.comm's ring here: driven from this thread between GEMMs, a ring all-reduce advances
only when the thread comes back to it, so its dependent all-gather step lags a GEMM behind
(bench primitives, 2 ranks, 1 Gbit/s, 4 chunks: 108 ms for the driven ring, 89 ms for the
backend's asynchronous all-reduce of the same pieces, 122 ms serial).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from oases import _checks
from oases.comm.topology import Ring, ring_of
from oases.costs.chunks import op_chunks
from oases.ops import gemm
from oases.ops._autocast import autocast_operands

__all__ = ["linear_all_reduce"]


class _LinearAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, ring: Ring, chunks: int, main_grad: Optional[torch.Tensor]):
        x2 = x.reshape(-1, x.shape[-1])  # [m, k]
        y = x2.new_empty((*x.shape[:-1], weight.shape[0]))  # [..., o], returned as is (no view)
        y2 = y.view(-1, weight.shape[0])  # [m, o]
        m = x2.shape[0]
        works = []
        for k in range(chunks):
            rows = slice(k * m // chunks, (k + 1) * m // chunks)
            if rows.start == rows.stop:
                continue
            gemm.linear_into(x2[rows], weight, None, y2[rows])  # while earlier pieces travel
            if ring.size > 1:
                works.append(dist.all_reduce(y2[rows], group=ring.group, async_op=True))
        for work in works:
            work.wait()
        if bias is not None:
            y2.add_(bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.main_grad = bias is not None, main_grad
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = torch.matmul(grad_y, weight) if need_x else None
        grad_w = None
        if need_w and ctx.main_grad is not None:
            gemm.accumulate_main_grad(ctx.main_grad, g2, x.reshape(-1, x.shape[-1]))
        elif need_w:
            grad_w = g2.t().mm(x.reshape(-1, x.shape[-1]))
        grad_b = g2.sum(0) if ctx.has_bias and need_b else None
        return grad_x, grad_w, grad_b, None, None, None


@torch.compiler.disable  # one graph break under torch.compile, not one per ring step
def linear_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
    *,
    chunks: Optional[int] = None,
    main_grad: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """All-reduced linear of a feature shard (the row-parallel pattern without sequence parallel).

        y = sum(F.linear(x, weight) from every rank) + bias
        # x [..., k] (k: this rank's input features), weight [o, k]  ->  y [..., o]

    The flattened rows are cut into `chunks` near-equal pieces (any row count works); each
    piece's all-reduce overlaps the next piece's GEMM. Backward needs no communication (the
    all-reduce's adjoint is the identity on a replicated grad_y), so grad_bias is complete.

    main_grad (fp32, weight's shape): backward adds weight's gradient into it in fp32
    (`main_grad += grad_w`, Megatron's gradient-accumulation fusion) and returns none for weight.
    """
    x, weight, bias, precision = autocast_operands(x, weight, bias)
    _checks.floating("x", x)
    _checks.weight_bias(x, weight, bias)
    ring = ring_of(group)
    rows = x.numel() // max(x.shape[-1], 1)
    if chunks is None:  # Centauri's Algorithm 1 on default rates (oases.costs.chunks.op_chunks)
        chunks = op_chunks(
            rows,
            x.shape[-1],
            weight.shape[0],
            divides=None,
            max_chunks=max(1, min(8, rows)),
            comm_bytes=2 * (ring.size - 1) / ring.size * rows * weight.shape[0] * x.element_size(),
        )
    _checks.chunks_arg(chunks)
    gemm.check_main_grad(main_grad, weight)
    with precision, torch.profiler.record_function("oases::linear_all_reduce"):
        return _LinearAllReduce.apply(x, weight, bias, ring, chunks, main_grad)
