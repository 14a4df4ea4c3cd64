"""Whether Triton's interpreter (TRITON_INTERPRET=1, the CPU harness) can run the kernels here.

Triton 3.6's interpreter turns a kernel's integer argument into a one-element numpy array and
calls int() on it for `range(0, K, BLOCK_K)`; numpy 2.5 refuses that ("only 0-dimensional arrays
can be converted to Python scalars"), so every GEMM kernel fails there (the H200 image of 2026-11:
Triton 3.6.0). Triton 3.7 (the pinned version) runs it. Tests that run a kernel under the
interpreter skip with this reason where the probe fails, and run everywhere else.
"""

from __future__ import annotations

import functools
from typing import Optional


@functools.lru_cache(maxsize=None)
def interpreter_failure() -> Optional[str]:
    """None where the interpreter runs a loop over a kernel argument (or is not in use), else why not."""
    from oases_kernels._gemm import interpreting

    if not interpreting():
        return None
    import numpy
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _count(out_ptr, n):
        total = tl.zeros((1,), dtype=tl.float32)
        for _ in range(0, n, 1):
            total += 1.0
        tl.store(out_ptr + tl.arange(0, 1), total)

    out = torch.zeros(1)
    try:
        _count[(1,)](out, 3)
    except Exception as error:  # the interpreter wraps what it hit in its own error type
        return (
            f"Triton {triton.__version__}'s interpreter cannot loop over a kernel argument with numpy "
            f"{numpy.__version__} ({error!r}); Triton 3.7 can"
        )
    if out.item() != 3.0:
        return f"Triton {triton.__version__}'s interpreter counted {out.item()} iterations of 3"
    return None
