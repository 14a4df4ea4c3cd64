"""linear_accumulate: a linear layer plus a partial result, added in the GEMM's epilogue.

A GEMM + reduce-scatter overlap sums partial products as they arrive; adding the incoming
partial inside the kernel (in fp32) saves a separate elementwise pass over the output.
"""

from typing import Optional

import torch

from ._gemm import DTYPES, check_dtype_device, check_operands, check_writable, launch_gemm, x_or_fp32


def linear_accumulate(
    x: torch.Tensor,
    weight: torch.Tensor,
    acc: torch.Tensor,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Compute a linear layer plus `acc`; return `out`.

        x (M, K), weight (N, K), acc (M, N), out (M, N) or None
        out = x @ weight.T + acc
        return out

    acc has x's dtype or fp32. Accumulation is fp32 and acc is added in fp32 before the cast to
    out's dtype; out defaults to a new tensor of x's dtype. In place (`out is acc`) is supported;
    a partial overlap of out with any input is not. Any strides are accepted. No autograd.
    """
    M, N, _ = check_operands(x, weight)
    if tuple(acc.shape) != (M, N):
        raise ValueError(f"acc: expected shape ({M}, {N}) = (x.shape[0], weight.shape[0]), got {tuple(acc.shape)}")
    check_dtype_device("acc", acc, x_or_fp32(x.dtype), x.device)
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (M, N):
        raise ValueError(f"out: expected shape ({M}, {N}) = (x.shape[0], weight.shape[0]), got {tuple(out.shape)}")
    check_dtype_device("out", out, DTYPES, x.device)
    check_writable("out", out)

    launch_gemm(x, weight, out, acc=acc)
    return out
