"""The parallel linears' from_linear and from_conv1d: a layer holding this rank's shard of a full
nn.Linear's or Hugging Face Conv1D's values (oases.nn.column, oases.nn.row)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.nn._layer_args import is_conv1d


def _from_conv1d(cls, conv: nn.Module, group: Optional[dist.ProcessGroup], kw: dict, shard_bias: bool):
    """A transposed `cls` layer holding this rank's shard of a Conv1D's values (and requires_grad flags)."""
    if not is_conv1d(conv):
        raise TypeError(f"conv: expected a Hugging Face Conv1D (weight [nx, nf]), got {type(conv).__name__}")
    if kw.get("transposed") is False:
        raise ValueError("transposed: a Conv1D keeps its [in, out] layout; do not pass transposed=False")
    kw = {**kw, "transposed": True}
    layer = torch.nn.utils.skip_init(
        cls,
        conv.nx,
        conv.nf,
        conv.bias is not None,
        group=group,
        device=conv.weight.device,
        dtype=conv.weight.dtype,
        **kw,
    )
    return _copy_shard(layer, conv, shard_bias)


def _from_linear(cls, linear: nn.Linear, group: Optional[dist.ProcessGroup], kw: dict, shard_bias: bool):
    """A `cls` layer holding this rank's shard of `linear`'s values (and requires_grad flags)."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
    layer = torch.nn.utils.skip_init(
        cls,
        linear.in_features,
        linear.out_features,
        linear.bias is not None,
        group=group,
        device=linear.weight.device,
        dtype=linear.weight.dtype,
        **kw,
    )
    return _copy_shard(layer, linear, shard_bias)


def _copy_shard(layer: nn.Module, linear: nn.Module, shard_bias: bool) -> nn.Module:
    """`layer` with this rank's shard of `linear`'s weight and bias (same layout), requires_grad kept;
    the bias sharded like the output features (shard_bias: a column layer's) or copied whole (a row layer's)."""
    with torch.no_grad():
        layer.weight.copy_(layer.shard(linear.weight))
        if linear.bias is not None:
            bias = layer.shard(linear.bias) if shard_bias else linear.bias
            layer.bias.copy_(bias)
    layer.weight.requires_grad_(linear.weight.requires_grad)
    if linear.bias is not None:
        layer.bias.requires_grad_(linear.bias.requires_grad)
    return layer
