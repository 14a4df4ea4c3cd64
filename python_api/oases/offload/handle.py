"""A saved tensor's handle (OffloadHandle), where its bytes are (OffloadState), and its record.

An Offloader (oases.offload.offloader) returns an OffloadHandle per saved tensor; the handle's mutable
state lives in a _Record apart from it, so that a finalizer can free a dead handle's memory.
"""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING, Hashable, Optional

import torch

from oases.offload.engine import CopyEvent

if TYPE_CHECKING:  # annotations only: the Offloader builds the handles
    from oases.offload.offloader import Offloader

__all__ = ["OffloadHandle", "OffloadState"]


class OffloadState(enum.Enum):
    """Where a saved tensor's bytes are (the state diagram in oases.offload.offloader's docstring)."""

    ON_DEVICE = "on device"
    IN_FLIGHT_OUT = "in flight out"
    ON_HOST = "on host"
    IN_FLIGHT_IN = "in flight in"
    RELEASED = "released"


class _Record:
    """A saved tensor's mutable state, apart from its handle so that a finalizer can see it."""

    __slots__ = (
        "state",
        "tensor",
        "order",
        "nbytes",
        "shape",
        "dtype",
        "device",
        "buffer",
        "offset",
        "profile_offset",
        "event",
        "batch",
        "peers",
        "offloaded",
        "resident",
        "region",
    )

    def __init__(self, tensor: torch.Tensor, order: Optional[list[int]]) -> None:
        self.state = OffloadState.ON_DEVICE
        self.tensor: Optional[torch.Tensor] = tensor
        self.order = order  # permutation making the tensor contiguous (None: it was copied contiguous)
        self.nbytes = tensor.numel() * tensor.element_size()
        self.shape, self.dtype, self.device = tuple(tensor.shape), tensor.dtype, tensor.device  # contiguous
        self.buffer: Optional[torch.Tensor] = None  # host bytes: the slab's buffer or a batch's own
        self.offset = 0
        self.profile_offset = 0  # while profiling: where the slab would have placed it
        self.event: Optional[CopyEvent] = None  # the copy in flight (out, then in)
        self.batch: Optional[int] = None  # which copy out moved it
        self.peers: list[weakref.ref] = []  # the handles that copy moved (weak: they die with their users)
        self.offloaded = False
        self.resident = True  # counted in resident_bytes
        self.region = False  # holds a slab region (freed on release or when the handle dies)


class OffloadHandle:
    """A handle on one saved tensor; `state` says where its bytes are (never blocks)."""

    def __init__(
        self, owner: "Offloader", record: _Record, group: Hashable, index: int, shape: tuple[int, ...]
    ) -> None:
        self._owner, self._record, self.group, self.index = owner, record, group, index
        self.nbytes, self.shape, self.dtype = record.nbytes, shape, record.dtype
        # A handle that dies holding memory (an autograd graph never run backward) hands its record
        # to the owner, which frees it at its next call: never from inside the collector.
        weakref.finalize(self, owner._dead.append, record)

    @property
    def state(self) -> OffloadState:
        """Where its bytes are now (never blocks): IN_FLIGHT_OUT becomes ON_HOST once its copy out is done."""
        r = self._record
        if r.state is OffloadState.IN_FLIGHT_OUT and r.event is not None and r.event.done():
            r.state, r.event = OffloadState.ON_HOST, None
        return r.state

    @property
    def batch(self) -> Optional[int]:
        """The number of the copy out that moved it (None: not offloaded)."""
        return self._record.batch

    def __repr__(self) -> str:
        return (
            f"OffloadHandle(#{self.index}, group={self.group!r}, {list(self.shape)} {self.dtype}, {self.state.value})"
        )
