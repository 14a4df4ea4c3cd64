"""Triton GEMM kernels for Oases' overlap schedules (fp32 accumulation, any strides).

::

    linear_into(x, weight, out, row_offset, bias):  out[row_offset : row_offset + M] = x @ weight.T (+ bias)
    linear_accumulate(x, weight, acc, out):         out = x @ weight.T + acc
"""

from .chunked_linear import linear_into
from .linear_accumulate import linear_accumulate

__all__ = ["linear_into", "linear_accumulate"]
