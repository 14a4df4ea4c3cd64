"""The GPT's sublayers (attention, MLP): pre-LN residual sublayers whose TP-local `core` the
oases.schedule schedules reduce, and `finish` with the residual dropout (oases.models.gpt's docstring).

The planner's profiles (bench/profile.py) time exactly these modules.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from oases._sharding import ShardRule
from oases.models._gpt_config import GPTConfig
from oases.ops import linear_unread
from oases.schedule import SubBatch


def _residual_dropout(y: torch.Tensor, p: float, seed: int, where: SubBatch) -> torch.Tensor:
    """Dropout with a mask drawn for the whole batch and sequence from `seed`, sliced to this
    sub-batch's rows and tokens: the same mask in forward and recomputation, whatever the split."""
    g = torch.Generator(device=y.device).manual_seed(seed)
    seq_len = y.shape[1] if where.seq_len is None else where.seq_len
    full = torch.rand((where.batch, seq_len, *y.shape[2:]), generator=g, device=y.device)
    keep = full[where.rows][:, where.positions] >= p
    return y * keep.to(y.dtype) / (1.0 - p)


class _Sublayer(nn.Module):
    """norm -> TP-local core -> (all-reduce by the schedule) -> finish: an oases.schedule.Sublayer.

    `tp_layout()` says which parameters are TP shards (oases._sharding); `group` is their group."""

    def __init__(self, config: GPTConfig, index: int, group: Optional[dist.ProcessGroup]) -> None:
        super().__init__()
        self.config, self.index, self.group = config, index, group
        self.norm = nn.LayerNorm(config.hidden)

    def finish(self, z: torch.Tensor, where: SubBatch) -> torch.Tensor:
        y = z + self.out_bias
        if where.seed is None or self.config.dropout == 0.0:
            return y
        return _residual_dropout(y, self.config.dropout, where.seed * 1_000_003 + self.index, where)

    def sequence_parallel_parameters(self) -> list[nn.Parameter]:
        """What norm and finish use (summed over the group under sequence parallelism)."""
        return [*self.norm.parameters(), self.out_bias]


class _Attention(_Sublayer):
    def __init__(self, config: GPTConfig, index: int, tp: int, group: Optional[dist.ProcessGroup]) -> None:
        super().__init__(config, index, group)
        self.local_heads = config.heads // tp
        head_dim = config.hidden // config.heads
        self.qkv = nn.Linear(config.hidden, 3 * self.local_heads * head_dim)  # column-parallel
        self.proj = nn.Linear(self.local_heads * head_dim, config.hidden)  # row-parallel

    @property
    def out_bias(self) -> nn.Parameter:
        return self.proj.bias  # replicated: added once, after the reduction

    def tp_layout(self) -> dict[str, ShardRule]:
        qkv = ShardRule(0, stacked=3)  # [q | k | v], each cut by heads
        return {"qkv.weight": qkv, "qkv.bias": qkv, "proj.weight": ShardRule(1)}

    def core(self, h: torch.Tensor, ctx: object = None) -> torch.Tensor:
        return F.linear(self._heads(h), self.proj.weight)  # partial sum of the out-projection

    def core_for_gradients(self, h: torch.Tensor, ctx: object = None) -> torch.Tensor:
        """core's graph, its value unread: the out-projection's GEMM not run (oases.schedule.protocol)."""
        return linear_unread(self._heads(h), self.proj.weight)

    def _heads(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        qkv = self.qkv(h).view(b, t, 3, self.local_heads, -1)  # (b, t, 3, nh_local, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (b, nh_local, t, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, -1)  # (b, t, nh_local * hd)


class _MLP(_Sublayer):
    def __init__(self, config: GPTConfig, index: int, tp: int, group: Optional[dist.ProcessGroup]) -> None:
        super().__init__(config, index, group)
        width = config.mlp_ratio * config.hidden // tp
        self.fc1 = nn.Linear(config.hidden, width)  # column-parallel
        self.fc2 = nn.Linear(width, config.hidden)  # row-parallel

    @property
    def out_bias(self) -> nn.Parameter:
        return self.fc2.bias

    def tp_layout(self) -> dict[str, ShardRule]:
        return {"fc1.weight": ShardRule(0), "fc1.bias": ShardRule(0), "fc2.weight": ShardRule(1)}

    def core(self, h: torch.Tensor, ctx: object = None) -> torch.Tensor:
        return F.linear(F.gelu(self.fc1(h)), self.fc2.weight)

    def core_for_gradients(self, h: torch.Tensor, ctx: object = None) -> torch.Tensor:
        """core's graph, its value unread: fc2's GEMM not run (oases.schedule.protocol)."""
        return linear_unread(F.gelu(self.fc1(h)), self.fc2.weight)
