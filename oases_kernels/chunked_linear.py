"""linear_into: a linear layer whose output lands in a row slice of a larger buffer.

An all-gather + GEMM overlap computes one gathered chunk at a time; writing each chunk's rows
straight into the full output (no temporary, no copy) is what this kernel is for.
"""

from typing import Optional

import torch

from ._gemm import DTYPES, check_dtype_device, check_operands, check_writable, launch_gemm, x_or_fp32


def linear_into(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    row_offset: int = 0,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Compute a linear layer into rows of `out`; return the rows written.

        x (M, K), weight (N, K), bias (N,) or None, out (R, N) with R >= row_offset + M
        out[row_offset : row_offset + M] = x @ weight.T (+ bias)
        return out[row_offset : row_offset + M]

    Any strides are accepted for every tensor. Accumulation is fp32; bias (x's dtype or fp32)
    is added in fp32; the result is cast to out's dtype (fp32, fp16 or bf16). Other rows of
    `out` are left untouched. `out` must not overlap x, weight or bias. No autograd.
    """
    M, N, _ = check_operands(x, weight)
    if isinstance(row_offset, bool) or not isinstance(row_offset, int) or row_offset < 0:
        raise ValueError(f"row_offset: expected an int >= 0, got {row_offset!r}")
    if out.dim() != 2 or out.shape[1] != N:
        raise ValueError(f"out: expected shape (R, {N}) (N = weight.shape[0]), got {tuple(out.shape)}")
    if out.shape[0] < row_offset + M:
        raise ValueError(
            f"out: has {out.shape[0]} rows but row_offset + M = "
            f"{row_offset} + {M} = {row_offset + M}; allocate at least that many "
            "rows or lower row_offset"
        )
    check_dtype_device("out", out, DTYPES, x.device)
    check_writable("out", out)
    if bias is not None:
        if tuple(bias.shape) != (N,):
            raise ValueError(f"bias: expected shape ({N},) (N = weight.shape[0]), got {tuple(bias.shape)}")
        check_dtype_device("bias", bias, x_or_fp32(x.dtype), x.device)

    rows = out[row_offset : row_offset + M]  # (M, N) view: the kernel stores into it directly
    launch_gemm(x, weight, rows, bias=bias)
    return rows
