"""Leaves of the graphs a schedule records: tensors that require grad and that torch.autocast does
not keep alive.

    leaf = grad_leaf(t)   # t's values, detached from t's graph, requires_grad=True;
                          # after a backward through it, leaf.grad holds its gradient

torch.autocast caches the low-precision cast of every fp32 tensor that requires grad, is a leaf
and is not a view (meant for the weights: cast once per step), and keeps the cache, holding the
tensor, until the outermost autocast region exits. The leaves a schedule makes (the input of
each recomputed sublayer, the gathered input of a sequence-parallel one, a stage's received
input) would be cached too: each would stay alive with its cast and its .grad until the step
ends, and recomputation would save no memory (measured: every sublayer's norm output, its bf16
cast and its gradient held to the end of the backward). As views they are not cached; autograd
treats them as any leaf.
"""

from __future__ import annotations

import torch

__all__ = ["grad_leaf"]


def grad_leaf(t: torch.Tensor) -> torch.Tensor:
    """A leaf that requires grad, with t's values and storage, that torch.autocast does not cache."""
    return t.detach().view_as(t).requires_grad_()
