"""Moving a batch's rows between TP degrees: the resharding autograd functions.

    x [B, ...] at degree p (every rank)  --reshard_rows(p -> d)-->  x [~B d / p, ...], replica r // d's rows
    reshard_rows to a lower degree:  fwd: keep this rank's sub-block   bwd: all-gather the rows
    reshard_rows to a higher degree: fwd: all-gather the rows          bwd: keep this rank's sub-block
    (over the hi / lo ranks that share the higher degree's replica and the lower degree's TP position:
    oases.degrees.placements.RowGroup)

Blocks of unequal size are all-gathered padded to the largest (oases._rows.padded / unpadded).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from oases import comm as _comm
from oases._rows import own_part, padded, unpadded
from oases.degrees.placements import RowGroups

__all__ = ["RowsDown", "RowsUp", "reshard_rows"]


def _gather_parts(x: torch.Tensor, group: Optional[dist.ProcessGroup], sizes: tuple[int, ...]) -> torch.Tensor:
    """cat(x from each rank of `group`, dim 0) [sum(sizes), ...]; rank k's x has sizes[k] rows."""
    return unpadded(_comm.ring_all_gather(padded(x.contiguous(), sizes), group, dim=0), sizes)


class RowsDown(torch.autograd.Function):
    """fwd: keep part `index` along dim 0 (parts of `sizes` rows; local); bwd: all-gather dim 0
    over `group`. Dual of RowsUp."""

    @staticmethod
    def forward(ctx, x, group, sizes: tuple[int, ...], index: int):
        """x [sum(sizes), ...] -> part `index` [sizes[index], ...]."""
        ctx.group, ctx.sizes = group, sizes
        return own_part(x, sizes, index)

    @staticmethod
    def backward(ctx, grad):
        """grad [sizes[index], ...] -> the parts' gradients gathered [sum(sizes), ...]."""
        return _gather_parts(grad, ctx.group, ctx.sizes), None, None, None


class RowsUp(torch.autograd.Function):
    """fwd: all-gather dim 0 over `group` (rank k holding sizes[k] rows); bwd: keep part `index`.
    Dual of RowsDown."""

    @staticmethod
    def forward(ctx, x, group, sizes: tuple[int, ...], index: int):
        """x [sizes[rank], ...] on each rank -> the parts gathered [sum(sizes), ...]."""
        ctx.sizes, ctx.index = sizes, index
        return _gather_parts(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        """grad [sum(sizes), ...] -> part `index` [sizes[index], ...]."""
        return own_part(grad, ctx.sizes, ctx.index), None, None, None


def reshard_rows(x: torch.Tensor, a: int, b: int, row_groups: RowGroups, batch: int) -> torch.Tensor:
    """x: this rank's replica's rows of a batch of `batch` rows at degree a -> its rows at degree b
    ([~batch a / p, ...] -> [~batch b / p, ...]; `row_groups` from make_placements; the identity
    when a == b)."""
    if a == b:
        return x
    move = row_groups[min(a, b), max(a, b)]
    return (RowsDown if b < a else RowsUp).apply(x, move.group, move.sizes(batch), move.index)
