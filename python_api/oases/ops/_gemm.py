"""The compute side of the fused ops: `out = x @ W.T (+ bias)` written into a caller's slice.

Paths are chosen by named predicates only:
  _use_triton(x)       CUDA fp32/fp16/bf16 tensors with Triton importable: oases_kernels.linear_into, and
                       linear_accumulate for the reduce-scatter pipeline (accumulate_linear)
  _needs_row_padding(x) CPU BLAS (MKL) takes a different kernel below 16 rows, whose results
                        differ in the last bit; such pieces are computed padded to 16 rows so a
                        row's result never depends on how the rows were chunked.
  otherwise            torch.addmm / torch.mm into the output slice.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

_SMALL_GEMM_ROWS = 16


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    try:
        import oases_kernels  # noqa: F401
    except ImportError:
        return False
    return True


_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in _TRITON_DTYPES and _triton_available()


def _needs_row_padding(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and 0 < x.shape[0] < _SMALL_GEMM_ROWS


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """out[...] = x @ weight.T (+ bias), for 2-D x [m, k] and out [m, n] (a contiguous slice)."""
    if _use_triton(x):
        import oases_kernels

        oases_kernels.linear_into(x, weight, out, 0, bias)
    elif _needs_row_padding(x):
        padded = x.new_zeros((_SMALL_GEMM_ROWS, x.shape[1]))
        padded[: x.shape[0]].copy_(x)
        result = padded.new_empty((_SMALL_GEMM_ROWS, weight.shape[0]))
        linear_into(padded, weight, bias, result)
        out.copy_(result[: x.shape[0]])
    elif bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


def accumulate_linear(x: torch.Tensor, weight: torch.Tensor, acc: torch.Tensor) -> None:
    """acc += x @ weight.T in place (x [..., k], acc [..., o]), with the Triton accumulate epilogue."""
    import oases_kernels

    oases_kernels.linear_accumulate(rows2d(x), weight, rows2d(acc), out=rows2d(acc))


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
    low = weight.dtype in (torch.float16, torch.bfloat16)
    return torch.zeros(weight.shape, dtype=torch.float32 if low else weight.dtype, device=weight.device)


def accumulate_weight_grad(acc: torch.Tensor, grad_y: torch.Tensor, x: torch.Tensor) -> None:
    """acc += grad_y.T @ x for 2-D grad_y [m, o] and x [m, k]; each piece rounds once."""
    if acc.dtype == grad_y.dtype:
        acc.addmm_(grad_y.t(), x)
    else:
        acc.add_(torch.mm(grad_y.t(), x))
