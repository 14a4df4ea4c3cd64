"""An RMS norm over features that are sharded over the tensor-parallel ranks.

OLMo-2 normalises its queries and keys over the whole projected width (heads * head_dim) before
splitting them into heads (`q_norm`, `k_norm`). Once q_proj / k_proj are column-parallel, rank r
holds the features [r*n/p, (r+1)*n/p) of that width, so the mean of squares must be taken over
the group (p ranks, r this rank; x_r [..., n/p] this rank's features of x [..., n]):

    ShardedRMSNorm   weight w[r*n/p : (r+1)*n/p]  [n/p]                     tp_layout: ShardRule(0)
        forward(x_r) -> y_r [..., n/p]
            h    = x_r in fp32
            ss   = sum_over_tp(sum(h * h, -1))           # [..., 1]; fwd all-reduce, bwd all-reduce
            y_r  = (scale * (h * rsqrt(ss / n + eps))).to(x_r.dtype),   scale = w  (or 1 + w)

`sum_over_tp` is its own adjoint: in forward every rank gets the sum of the ranks' partial sums of
squares, and in backward each rank's gradient of that sum (its heads' share) is summed over the
ranks, so every rank's gradient of its own x_r and w_r is the matching slice of the unsharded
norm's. The all-reduces run inside the norm whatever the mode (also under
`no_tp_communication`: the schedules' reductions do not cover it). `unit_offset=True` is Gemma's
form, scale = 1 + w.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases._checks import process_group
from oases._sharding import ShardRule
from oases.comm.topology import ring_of
from oases.nn.mappings import sum_over_tp

__all__ = ["ShardedRMSNorm"]


class ShardedRMSNorm(nn.Module):
    """RMSNorm over `features` features of which this rank holds features/p (see the module doc).

    y_r = scale * x_r / sqrt(mean over all `features` of x^2 + eps)    # the mean over the group
    """

    def __init__(
        self,
        features: int,
        eps: float,
        *,
        group: Optional[dist.ProcessGroup] = None,
        unit_offset: bool = False,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        group = process_group(group)  # a 1-D DeviceMesh: its group
        ring = ring_of(group)
        if features % ring.size:
            raise ValueError(
                f"{type(self).__name__}: features={features} is not divisible by the tensor-parallel "
                f"world size {ring.size}"
            )
        self.features, self.eps, self.unit_offset = features, eps, unit_offset
        self.group, self.world_size, self.rank = group, ring.size, ring.rank
        full = (
            torch.zeros(features, device=device, dtype=dtype)
            if unit_offset
            else torch.ones(features, device=device, dtype=dtype)
        )
        self.weight = nn.Parameter(self.shard(full).clone())  # [features/p]

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's entries of a full [features] weight (a view)."""
        return ShardRule(0).shard(full, self.rank, self.world_size)

    def tp_layout(self) -> dict[str, ShardRule]:
        """How the weight cuts the full norm's: ShardRule(0), this rank's features."""
        return {"weight": ShardRule(0)}

    @classmethod
    def from_norm(
        cls, norm: nn.Module, group: Optional[dist.ProcessGroup] = None, *, eps: float, unit_offset: bool = False
    ) -> "ShardedRMSNorm":
        """This rank's shard of an RMS norm with a [features] `weight` (values and requires_grad copied)."""
        weight = norm.weight
        layer = torch.nn.utils.skip_init(
            cls, weight.shape[0], eps, group=group, unit_offset=unit_offset, device=weight.device, dtype=weight.dtype
        )
        with torch.no_grad():
            layer.weight.copy_(layer.shard(weight))
        layer.weight.requires_grad_(weight.requires_grad)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x_r [..., features/p] -> y_r [..., features/p], normalised over all the features (module doc)."""
        h = x.float()  # [..., features/p]
        ss = sum_over_tp(h.pow(2).sum(-1, keepdim=True), self.group)  # [..., 1]: over all features
        h = h * torch.rsqrt(ss / self.features + self.eps)
        scale = 1.0 + self.weight.float() if self.unit_offset else self.weight
        return (scale * h).to(x.dtype)

    def extra_repr(self) -> str:
        """The sizes, this rank's shard and unit_offset if set."""
        return (
            f"features={self.features}, eps={self.eps}, tp={self.world_size} (rank {self.rank}: "
            f"{self.weight.shape[0]})" + (", unit_offset=True" if self.unit_offset else "")
        )
