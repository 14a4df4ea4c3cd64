"""The autograd functions of a stage with offload: a layer whose input is kept in an Offloader (recomputed in
backward), and a received stage input that enters the graph without being kept."""

from __future__ import annotations

from typing import Hashable

import torch

from oases._leaves import grad_leaf
from oases.offload import Offloader

__all__ = ["OffloadedLayer", "StageInput"]


class OffloadedLayer(torch.autograd.Function):
    """y = layer(x) with x kept in an Offloader, recomputed in backward (reentrant-style activation checkpointing:
    the recomputation's backward accumulates the parameters' .grad and returns x's gradient; the
    CPU random state of the forward is restored for it, as torch.utils.checkpoint does).
    `anchor`: a tensor that requires grad, so the output does even when x does not."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, anchor: torch.Tensor, layer, offloader: Offloader, group: Hashable, handles: list
    ) -> torch.Tensor:
        ctx.layer, ctx.offloader, ctx.needs_x = layer, offloader, x.requires_grad
        ctx.rng = torch.get_rng_state()
        ctx.saved = offloader.save(x.detach(), group=group)
        handles.append(ctx.saved)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x = ctx.offloader.get(ctx.saved)
        x = grad_leaf(x) if ctx.needs_x else x.detach()  # (not cached by autocast: oases._leaves)
        ctx.offloader.release(ctx.saved)
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.set_rng_state(ctx.rng)
            y = ctx.layer(x)
        torch.autograd.backward(y, grad)
        return (x.grad if ctx.needs_x else None), None, None, None, None, None


class StageInput(torch.autograd.Function):
    """x = StageInput.apply(anchor, received, sink, key): `received` entering the stage's autograd
    graph without becoming a leaf the pipeline must keep (its memory can go with its offloaded
    copy); backward puts its gradient in sink[key]. `anchor`: any tensor requiring grad."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, received: torch.Tensor, sink: dict, key: Hashable) -> torch.Tensor:
        ctx.sink, ctx.key = sink, key
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.sink[ctx.key] = grad
        return None, None, None, None
