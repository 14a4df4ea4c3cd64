"""linear_unread: F.linear(x, weight)'s autograd graph without its value (no forward GEMM).

::

    y = linear_unread(x, weight)       # y [..., out]: zeros, NOT x @ weight.T
    y.backward(g)                      # == F.linear(x, weight).backward(g), bit for bit:
                                       #    x.grad += g @ weight; weight.grad += g.T @ x
                                       #    (main_grad given: main_grad += g.T @ x in fp32 instead)

The reference is F.linear itself. A linear's backward never reads its output, so a graph that is
only differentiated, never read (oases.schedule's fine-grained recomputation reruns a sublayer to
differentiate it: the row-parallel output projection's value is not needed there) can skip the
GEMM. Under torch.autocast the operands are cast as F.linear casts them (oases.ops._autocast).
The gradients follow torch's own mm backward (FunctionsManual's mm_mat1/mm_mat2_backward: the
same products in the same layouts), so they equal F.linear's exactly.
"""

from __future__ import annotations

from typing import Optional

import torch

from oases import _checks
from oases.ops import gemm
from oases.ops._autocast import autocast_operands

__all__ = ["linear_unread"]


def _column_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) == t.shape[0]


class _LinearUnread(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, main_grad: Optional[torch.Tensor]):
        ctx.save_for_backward(x, weight)
        ctx.main_grad = main_grad
        return x.new_zeros((*x.shape[:-1], weight.shape[0]))  # the value nobody reads

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        g2 = grad_y.reshape(-1, grad_y.shape[-1])  # [m, o]
        x2 = x.reshape(-1, x.shape[-1])  # [m, k]
        w_t = weight.t()  # F.linear multiplies x2 [m, k] by mat2 = weight.T [k, o]
        grad_x = grad_w = None
        if need_x:
            g_x = w_t.mm(g2.t()).t() if _column_major(x2) else g2.mm(w_t.t())  # mm_mat1_backward
            grad_x = g_x.reshape(x.shape)
        if need_w and ctx.main_grad is not None:
            gemm.accumulate_main_grad(ctx.main_grad, g2, x2)  # weight's gradient goes there
        elif need_w:
            grad_w_t = g2.t().mm(x2).t() if _column_major(w_t) else x2.t().mm(g2)  # mm_mat2_backward
            grad_w = grad_w_t.t()
        return grad_x, grad_w, None


def linear_unread(x: torch.Tensor, weight: torch.Tensor, *, main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight)'s autograd graph without its value: for a graph that is only
    differentiated, never read::

        y = linear_unread(x, weight)    # x [..., k], weight [o, k]  ->  y [..., o], zeros (unspecified)
        y.backward(g)                   # exactly F.linear(x, weight).backward(g):
                                        #   x.grad += g @ weight;  weight.grad += g.T @ x

    No forward GEMM runs. Under torch.autocast the operands are cast as F.linear casts them.
    main_grad (fp32, weight's shape): backward adds weight's gradient into it in fp32 and returns
    none for weight (gradient-accumulation fusion, as oases.nn's layers do).
    """
    x, weight, _, autocast_off = autocast_operands(x, weight, None)
    _checks.floating("x", x)
    _checks.weight_bias(x, weight, None)
    gemm.check_main_grad(main_grad, weight)
    with autocast_off:
        return _LinearUnread.apply(x, weight, main_grad)
