"""The shared entry of a TP region (oases.nn.layers' column layers, set by `parallelize`)."""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist

from oases.nn.mappings import copy_to_tp


class _SharedEntry:
    """Where replicated activations enter one group's TP region, shared by the column layers
    `parallelize` makes: layers fed the same input tensor one after the other (q, k, v; gate, up)
    reuse one copy_to_tp of it, so its gradient is all-reduced once, after autograd has summed
    theirs, not once per layer. The entry is held until its gradient arrives or the next input
    comes (whichever is first); inference tensors, which carry no version, are not shared.
    """

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        self._last: Optional[tuple[weakref.ref, tuple, torch.Tensor]] = None

    @torch.compiler.disable  # weakrefs and versions: one graph break under torch.compile
    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_inference():
            return copy_to_tp(x, self.group)
        key = (x._version, x.requires_grad, torch.is_grad_enabled())
        if self._last is not None and self._last[0]() is x and self._last[1] == key:
            return self._last[2]
        entered = copy_to_tp(x, self.group)
        self._last = (weakref.ref(x), key, entered)
        if entered.requires_grad:
            entered.register_hook(self._forget)
        return entered

    def _forget(self, grad: torch.Tensor) -> None:
        self._last = None
