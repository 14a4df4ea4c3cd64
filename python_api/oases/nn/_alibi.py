"""Per-head attention biases made by the base model (ALiBi) cut to this rank's heads.

BLOOM and Falcon build one ALiBi tensor for all H heads in the base model's forward and hand it to
every attention module (`alibi`, [b * H, 1, t] or [b, H, 1, t]; MPT's `position_bias`, [H, 1, t];
Falcon also folds it into the mask, `attention_mask` [b, H, q, k]). Once the attention's head
projections are column-parallel, the module computes this rank's H/p heads (oases.nn._heads), so
it must get the slopes of those heads only:

    bias [b * H, ...]    -> view [b, H, ...][:, heads_r] -> [b * H/p, ...]      ([H, ...]: b = 1)
    bias [b, H, q, k]    -> bias[:, heads_r]                 (attention_mask: only this form; a
                                                              mask [b, 1, q, k] is left as it is)
    heads_r = [r H/p, (r+1) H/p)     (r: this rank in the attention's TP group, as q_proj's rows)

A forward pre-hook on the attention module does the cut at each call (the tensor is the model's,
built per batch), by keyword or by its position in the module's forward.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["BIAS_ARGUMENTS", "slice_head_biases", "takes_head_biases"]

BIAS_ARGUMENTS = ("alibi", "position_bias")
_PER_HEAD_MASK = "attention_mask"


def _cut(bias: object, heads: int, r: int, p: int, mask: bool = False) -> object:
    if not isinstance(bias, torch.Tensor) or bias.dim() < 2:
        return bias
    local = heads // p
    if bias.dim() == 4 and bias.shape[1] == heads:
        return bias[:, r * local : (r + 1) * local]
    if mask:
        return bias
    if bias.shape[0] % heads:
        raise ValueError(
            f"oases: an attention bias of shape {tuple(bias.shape)} does not hold {heads} heads' "
            f"rows ([b * heads, ...] or [b, heads, q, k]); oases cannot give this rank its heads' rows"
        )
    b = bias.shape[0] // heads
    return bias.reshape(b, heads, *bias.shape[1:])[:, r * local : (r + 1) * local].reshape(b * local, *bias.shape[1:])


def takes_head_biases(module: nn.Module) -> bool:
    """Whether the attention module's forward takes one of BIAS_ARGUMENTS."""
    names = inspect.signature(module.forward).parameters
    return any(n in names for n in BIAS_ARGUMENTS)


def slice_head_biases(module: nn.Module, heads: int, group: dist.ProcessGroup) -> bool:
    """Register the pre-hook on an attention module whose forward takes one of BIAS_ARGUMENTS;
    `heads` is its full query head count. True if registered."""
    names = list(inspect.signature(module.forward).parameters)
    found = [n for n in BIAS_ARGUMENTS if n in names]
    if not found:
        return False
    found += [_PER_HEAD_MASK] if _PER_HEAD_MASK in names else []
    r, p = dist.get_rank(group), dist.get_world_size(group)

    def cut(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = list(args)
        for name in found:
            mask = name == _PER_HEAD_MASK
            if name in kwargs:
                kwargs[name] = _cut(kwargs[name], heads, r, p, mask)
            elif names.index(name) < len(args):
                args[names.index(name)] = _cut(args[names.index(name)], heads, r, p, mask)
        return tuple(args), kwargs

    module.register_forward_pre_hook(cut, with_kwargs=True)
    return True
