"""How a full weight is cut into tensor-parallel shards (rank r of p), for layers and models alike.

    column_shard(W [out, ...], r, p, stacked=s):  the r-th slice of each of the s equal blocks of
                                                  dim 0 (s = 3 for a fused q|k|v), concatenated
    row_shard(W [..., in], r, p):                 W[..., r*in/p : (r+1)*in/p]
Both return views.
"""
from __future__ import annotations

import torch

__all__ = ["column_shard", "row_shard"]


def column_shard(t: torch.Tensor, rank: int, world_size: int, stacked: int = 1) -> torch.Tensor:
    blocks = t.unflatten(0, (stacked, world_size, t.shape[0] // (stacked * world_size)))
    return blocks[:, rank].flatten(0, 1)  # [stacked * out/(stacked p), ...]


def row_shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return t.chunk(world_size, dim=-1)[rank]
