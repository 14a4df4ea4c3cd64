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
import torch.nn as nn

from oases._sharding import clip_sharded_, copied_rows, sharded_parameters

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
    groups, copied = sharded_parameters(model), copied_rows(model)
    params = _unique(model.parameters())
    grads = [(p.grad, groups.get(id(p)), copied.get(id(p), ()), 0) for p in params]
    device = next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))  # NCCL: device tensors
    return clip_sharded_(grads, max_norm, norm_type, device)


def _unique(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
