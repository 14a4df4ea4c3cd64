"""Plain references of the fused ops: one torch.distributed collective, then F.linear.

Same signatures and results as the fused ops in `oases.ops` (the oracle in tests and the serial
baseline in benchmarks); `chunks` and `bidirectional` are accepted and ignored. Forward only in
the collective sense: torch's collectives are not differentiable, so use these for values, and
the single-process model for gradients.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["all_gather_linear", "linear_reduce_scatter", "linear_all_reduce"]


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    p = dist.get_world_size(group)
    rows = x.movedim(dim, 0).contiguous()
    out = rows.new_empty((p * rows.shape[0], *rows.shape[1:]))
    dist.all_gather_into_tensor(out, rows, group=group)
    return out.movedim(0, dim)


def all_gather_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
    *,
    dim: int = 0,
    chunks=None,
    bidirectional: bool = False,
) -> torch.Tensor:
    """y = F.linear(all_gather(x, dim), weight, bias) with torch's blocking all-gather."""
    return F.linear(_all_gather(x, group, dim), weight, bias)


def linear_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
    *,
    dim: int = 0,
    chunks=None,
    bidirectional: bool = False,
) -> torch.Tensor:
    """y = reduce_scatter(F.linear(x, weight), dim) + bias with torch's blocking reduce-scatter."""
    p = dist.get_world_size(group)
    partial = F.linear(x, weight).movedim(dim, 0).contiguous()
    out = partial.new_empty((partial.shape[0] // p, *partial.shape[1:]))
    dist.reduce_scatter_tensor(out, partial, group=group)
    out = out.movedim(0, dim)
    return out if bias is None else out + bias


def linear_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
    *,
    chunks=None,
) -> torch.Tensor:
    """y = all_reduce(F.linear(x, weight)) + bias with torch's blocking all-reduce."""
    y = F.linear(x, weight)
    dist.all_reduce(y, group=group)
    return y if bias is None else y + bias
