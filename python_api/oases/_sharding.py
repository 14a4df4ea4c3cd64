"""How a full tensor is cut into tensor-parallel shards (rank r of p), for layers and models alike.

    column_shard(W [out, ...], r, p, stacked=s):  the r-th slice of each of the s equal blocks of
                                                  dim 0 (s = 3 for a fused q|k|v), concatenated
    row_shard(W [..., in], r, p):                 W[..., r*in/p : (r+1)*in/p]
Both return views.

A module whose parameters are TP shards says how, as data: `tp_layout()` maps a parameter's
name (relative to the module, e.g. "weight") to a `ShardRule`; parameters it does not list are
replicated. Checkpointing, initialisation and tests read it instead of knowing module types:

    ColumnParallelLinear.tp_layout() == {"weight": ShardRule(0, stacked), "bias": ShardRule(0, stacked)}
    RowParallelLinear.tp_layout()    == {"weight": ShardRule(1)}           # bias replicated
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ShardRule", "column_shard", "row_shard", "tp_rules", "sharded_parameters"]


@dataclass(frozen=True)
class ShardRule:
    """A parameter cut along `dim` into p equal parts, blockwise when `stacked` > 1 (dim 0 only)."""

    dim: int
    stacked: int = 1

    def shard(self, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        """This rank's part of the full tensor (a view)."""
        if self.dim == 0:
            return column_shard(full, rank, world_size, self.stacked)
        return full.chunk(world_size, dim=self.dim)[rank]

    def unshard(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's part, in rank order (the inverse of `shard`)."""
        if self.dim != 0 or self.stacked == 1:
            return torch.cat(parts, dim=self.dim)
        blocks = [p.chunk(self.stacked, 0) for p in parts]  # [rank][block]
        return torch.cat([blocks[r][b] for b in range(self.stacked) for r in range(len(parts))])


def column_shard(t: torch.Tensor, rank: int, world_size: int, stacked: int = 1) -> torch.Tensor:
    blocks = t.unflatten(0, (stacked, world_size, t.shape[0] // (stacked * world_size)))
    return blocks[:, rank].flatten(0, 1)  # [stacked * out/(stacked p), ...]


def row_shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return t.chunk(world_size, dim=-1)[rank]


def tp_rules(model: torch.nn.Module) -> dict[str, tuple[ShardRule, "object"]]:
    """{qualified parameter name: (its ShardRule, its module's group)} for every parameter a
    module's `tp_layout()` lists (a name there may reach into a child: "qkv.weight")."""
    found: dict[str, tuple[ShardRule, object]] = {}
    for prefix, module in model.named_modules():
        layout = getattr(module, "tp_layout", None)
        if callable(layout):
            for name, rule in layout().items():
                found[f"{prefix}.{name}" if prefix else name] = (rule, module.group)
    return found


def sharded_parameters(model: torch.nn.Module) -> dict[int, "object"]:
    """{id(parameter): its process group} for every parameter a module's `tp_layout()` lists."""
    return {id(model.get_parameter(name)): group for name, (_, group) in tp_rules(model).items()}
