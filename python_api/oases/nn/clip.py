"""Gradient clipping by the norm of the whole (unsharded) model's gradient.

torch.nn.utils.clip_grad_norm_ on a tensor-parallel model sees only this rank's shards: each rank
would clip by a different, too small norm. Here a TP shard's squares are summed over its group
and a replicated parameter counts once (and rows several ranks of a group hold alike, key-value
heads at p > kv_heads, once: weighted 1 / copies), so every rank gets the unsharded model's norm:

    total = sqrt( sum_replicated |g|^2 + sum_groups all_reduce_sum(sum_sharded |g|^2) )   # norm_type 2
    total = max( max_replicated |g|, all_reduce_max(max_sharded |g|) )                    # norm_type inf
    every g *= min(1, max_norm / (total + 1e-6))
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from oases._sharding import copied_rows, sharded_parameters, squares_once

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of `model`'s parameters in place by the unsharded model's gradient norm.

    ::

        total = norm of cat(every parameter's full gradient)       # as the unsharded model has it
        if total > max_norm: every .grad *= max_norm / (total + 1e-6)

    Returns `total` (an fp32 scalar on the gradients' device, the same on every rank). Call it on every rank of the TP
    group(s), like the backward. norm_type: 2.0 or inf.
    """
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type: only 2.0 and inf are supported, got {norm_type!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    groups = sharded_parameters(model)
    copied = copied_rows(model)
    grads = [
        (p.grad, groups.get(id(p), _REPLICATED), copied.get(id(p), ()))
        for p in _unique(model.parameters())
        if p.grad is not None
    ]
    inf = norm_type == math.inf
    combine = torch.maximum if inf else torch.add
    device = grads[0][0].device if grads else torch.device("cpu")  # NCCL reduces device tensors
    total = torch.zeros((), dtype=torch.float32, device=device)
    per_group: dict[int, tuple[object, torch.Tensor]] = {}
    for g, group, spans in grads:
        if g.numel() == 0:
            continue
        part = (g.detach().float().abs().max() if inf else squares_once(g, spans)).to(device)
        if group is _REPLICATED:
            total = combine(total, part)
        else:
            key = id(group)
            _, acc = per_group.get(key, (group, torch.zeros((), dtype=torch.float32, device=device)))
            per_group[key] = (group, combine(acc, part))
    for group, acc in per_group.values():
        if dist.is_initialized():
            dist.all_reduce(acc, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        total = combine(total, acc)
    total = total if inf else total.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g, _, _ in grads:
        g.detach().mul_(scale.to(g.device, g.dtype))
    return total


_REPLICATED = object()


def _unique(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
