"""The compute side of the fused ops: `out = x @ W.T (+ bias)` written into a caller's slice (public:
the fused ops, the layers' gradient-accumulation fusion and the bench's peers share these GEMMs).

Paths are chosen by named predicates only. On CUDA, Triton runs only where it fuses something
cuBLAS does not do in one call; every other GEMM is cuBLAS (torch.mm / torch.addmm with out=):

  linear_into            torch.addmm / torch.mm into the output slice (cuBLAS on CUDA): also
                         all_gather_linear's forward, each arriving piece into its rows of y.
                         (oases_kernels.linear_into, which stores the tiles into the slice from
                         Triton, ran at 0.63-0.69x cuBLAS's speed on an H200 with bf16 Llama-7B
                         shapes, and cuBLAS writes a row slice as fast as a whole tensor: see
                         bench/_cuda_gemm.py and docs/results/.)
      _needs_row_padding(x) CPU BLAS (MKL) takes a different kernel below 16 rows, whose results
                            differ in the last bit; such pieces are computed padded to 16 rows so
                            a row's result never depends on how the rows were chunked.
  accumulate_main_grad   main_grad += grad_y.T @ x in fp32 (Megatron's gradient-accumulation
                         fusion) for 16-bit x
      _use_triton(x)       oases_kernels.linear_accumulate: 16-bit tl.dot, fp32 accumulator,
                           main_grad added and stored in fp32 by the epilogue (one pass)
      otherwise            fp32 addmm_ of the upcast operands (exact products, fp32 sums)

The reduce-scatter's accumulate of a received partial is not fused into a GEMM: that GEMM would
have to wait for the transfer (see oases.comm.ring); it is an elementwise add on the comm side.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from oases._ranges import hot_range

__all__ = [
    "linear_into",
    "rows2d",
    "default_chunks",
    "weight_grad_buffer",
    "accumulate_weight_grad",
    "check_main_grad",
    "accumulate_main_grad",
]

_SMALL_GEMM_ROWS = 16


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    try:
        import oases_kernels  # noqa: F401
    except ImportError:
        return False
    return True


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _use_triton(x: torch.Tensor) -> bool:
    """16-bit CUDA operands with Triton importable (the only GEMM Triton runs: main_grad's)."""
    return x.is_cuda and x.dtype in _LOW_PRECISION and _triton_available()


def _needs_row_padding(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and 0 < x.shape[0] < _SMALL_GEMM_ROWS


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """out[...] = x @ weight.T (+ bias), for 2-D x [m, k] and out [m, n] (a contiguous slice); cuBLAS on CUDA."""
    with hot_range("oases::gemm"):
        if _needs_row_padding(x):
            padded = x.new_zeros((_SMALL_GEMM_ROWS, x.shape[1]))
            padded[: x.shape[0]].copy_(x)
            result = padded.new_empty((_SMALL_GEMM_ROWS, weight.shape[0]))
            linear_into(padded, weight, bias, result)
            out.copy_(result[: x.shape[0]])
        elif bias is None:
            torch.mm(x, weight.t(), out=out)
        else:
            torch.addmm(bias, x, weight.t(), out=out)


def rows2d(t: torch.Tensor) -> torch.Tensor:
    """View a contiguous [r, ..., f] tensor as [r * prod(...), f]."""
    return t.view(-1, t.shape[-1])


def default_chunks(rows_per_shard: int, row_elems: int) -> int:
    """Pieces per shard when the caller passes chunks=None.

    Two pieces per shard hide all but half a piece's compute behind communication; more pieces
    pay per-message latency. Keep each piece's GEMM at least 64 flattened rows.
    """
    for chunks in (2, 1):
        if rows_per_shard % chunks == 0 and (rows_per_shard // chunks) * row_elems >= 64:
            return chunks
    return 1


def weight_grad_buffer(weight: torch.Tensor) -> torch.Tensor:
    """A zeroed accumulator for a weight gradient summed over pieces (fp32 for 16-bit weights)."""
    low = weight.dtype in _LOW_PRECISION
    return torch.zeros(weight.shape, dtype=torch.float32 if low else weight.dtype, device=weight.device)


def accumulate_weight_grad(acc: torch.Tensor, grad_y: torch.Tensor, x: torch.Tensor) -> None:
    """acc += grad_y.T @ x for 2-D grad_y [m, o] and x [m, k]; each piece rounds once."""
    if acc.dtype == grad_y.dtype:
        acc.addmm_(grad_y.t(), x)
    else:
        acc.add_(torch.mm(grad_y.t(), x))


def check_main_grad(main_grad: Optional[torch.Tensor], weight: torch.Tensor) -> None:
    """main_grad: None, or an fp32 tensor of weight's shape on weight's device."""
    if main_grad is None:
        return
    if not isinstance(main_grad, torch.Tensor):
        raise TypeError(f"main_grad: expected a torch.Tensor or None, got {type(main_grad).__name__}")
    if main_grad.dtype != torch.float32:
        raise TypeError(f"main_grad: must be float32 (the fp32 gradient accumulator), got {main_grad.dtype}")
    if main_grad.shape != weight.shape or main_grad.device != weight.device:
        raise ValueError(
            f"main_grad: must have weight's shape {tuple(weight.shape)} on {weight.device}, "
            f"got {tuple(main_grad.shape)} on {main_grad.device}"
        )


def accumulate_main_grad(main_grad: torch.Tensor, grad_y: torch.Tensor, x: torch.Tensor) -> None:
    """main_grad += grad_y.T @ x in fp32, for 2-D grad_y [m, o] and x [m, k] of any float dtype.

    16-bit operands are multiplied exactly (upcast, or tensor cores with an fp32 accumulator on
    CUDA) and summed in fp32, with no rounding to 16 bits in between.
    """
    if grad_y.dtype not in _LOW_PRECISION:
        main_grad.addmm_(grad_y.t().to(main_grad.dtype), x.to(main_grad.dtype))
    elif _use_triton(grad_y):
        import oases_kernels

        # out [o, k] = grad_y.T [o, m] @ (x.T [k, m]).T + main_grad, read through strides.
        oases_kernels.linear_accumulate(grad_y.t(), x.t(), main_grad, out=main_grad)
    else:
        main_grad.addmm_(grad_y.t().float(), x.float())
