"""The fused ops under torch.autocast, as F.linear behaves there.

    with torch.autocast(device_type, dtype):   op(x, weight, bias, ...)
    ==  op(x.to(dtype), weight.to(dtype), bias.to(dtype), ...)   with autocast off inside the op

The casts are ordinary differentiable copies, so weight's gradient comes back in weight's own
dtype (fp32 parameters keep fp32 gradients) and the GEMMs and the communication run in `dtype`.
Outside autocast (or for a device type it is off for) the operands pass through unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

__all__ = ["autocast_operands"]


def autocast_operands(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], contextlib.AbstractContextManager]:
    """(x, weight, bias) cast to the autocast dtype of x's device type where autocast is on, and
    the context to run the op in (autocast off, so its GEMMs do not cast again)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not torch.is_autocast_enabled(x.device.type):
        return x, weight, bias, contextlib.nullcontext()
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind)

    def cast(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        ok = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype
        return t.to(dtype) if ok else t

    return cast(x), cast(weight), cast(bias), torch.autocast(kind, enabled=False)
