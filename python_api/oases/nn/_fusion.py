"""Gradient-accumulation fusion of the parallel linears (oases.nn.layers; its contract: the layers
guide, docs/guides/parallelize.md): the weight's gradient added, in fp32, into `weight.main_grad`
instead of being returned to autograd."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from oases.ops import gemm


class _LinearMainGrad(torch.autograd.Function):
    """y = F.linear(x, weight, bias); backward: main_grad += grad_w in fp32, no grad for weight."""

    @staticmethod
    def forward(ctx, x, weight, bias, main_grad):
        ctx.save_for_backward(x, weight)
        ctx.main_grad, ctx.has_bias = main_grad, bias is not None
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = grad_y.reshape(-1, grad_y.shape[-1])  # [m, o]
        grad_x = torch.matmul(grad_y, weight) if need_x else None
        if need_w:
            gemm.accumulate_main_grad(ctx.main_grad, g2, x.reshape(-1, x.shape[-1]))
        grad_b = g2.sum(0) if ctx.has_bias and need_b else None
        return grad_x, None, grad_b, None


def _main_grad(layer: nn.Module) -> Optional[torch.Tensor]:
    """`layer.weight.main_grad` when this forward's weight gradient goes there, else None."""
    weight = layer.weight
    if not layer.gradient_accumulation_fusion or not (torch.is_grad_enabled() and weight.requires_grad):
        return None
    if getattr(weight, "main_grad", None) is None:
        weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    gemm.check_main_grad(weight.main_grad, weight)
    return weight.main_grad


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], main_grad: Optional[torch.Tensor]
) -> torch.Tensor:
    if main_grad is None:
        return nn.functional.linear(x, weight, bias)
    return _LinearMainGrad.apply(x, weight, bias, main_grad)
