"""HostSlab: the one host buffer offloaded tensors live in, preallocated, and its allocator.

    slab = HostSlab(64 << 20)          # pinned when torch.cuda.is_available(), plain memory otherwise
    offset = slab.allocate(nbytes)     # a region [offset, offset + nbytes) of slab.buffer, 256-aligned
    slab.free(offset)                  # the region is free again (neighbours coalesce)

Regions are placed first-fit. A schedule replays the same allocations and frees in the same order
every step, so first-fit places them at the same offsets every step, and a slab of the
*high-water mark* of a profiling step (the largest region end it reached, `high_water`) holds
every later step exactly: that is how `Offloader()` sizes its slab (FOLD3D: "determined by
profiling the total activation size in an iteration"). A step that needs more raises
SlabTooSmallError saying how many bytes to ask for, before any byte of its batch moves.
"""

from __future__ import annotations

import bisect
import threading
from typing import Optional

import torch

from oases import _checks

__all__ = ["HostSlab", "SlabTooSmallError", "ALIGNMENT"]

ALIGNMENT = 256  # bytes: every region starts at a multiple (the CUDA copy kernel's words, DMA bursts)

_UNBOUNDED = 1 << 62  # the capacity of a profiling allocator (never reached)


class SlabTooSmallError(RuntimeError):
    """A step needs more host bytes than the slab holds. `needed`: the slab size to ask for (at
    least; the whole step's size comes from a profiling step, see oases.offload.Offloader)."""

    def __init__(self, message: str, needed: int) -> None:
        super().__init__(message)
        self.needed = needed


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _FirstFit:
    """First-fit placement of aligned regions in [0, capacity); frees coalesce with neighbours.

    allocate(n) -> offset or None (no free run of round_up(n, ALIGNMENT) bytes)
    free(offset)               KeyError when no region starts there
    high_water                 the largest end of a region ever placed
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._starts: list[int] = [0] if capacity > 0 else []  # free runs, sorted by start
        self._ends: list[int] = [capacity] if capacity > 0 else []
        self._used: dict[int, int] = {}  # start -> size of each allocated region
        self.in_use = 0
        self.high_water = 0

    def allocate(self, nbytes: int) -> Optional[int]:
        size = _round_up(nbytes, ALIGNMENT)
        for i, (start, end) in enumerate(zip(self._starts, self._ends)):
            if end - start >= size:
                if end - start == size:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = start + size
                self._used[start] = size
                self.in_use += size
                self.high_water = max(self.high_water, start + size)
                return start
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        self.in_use -= size
        start, end = offset, offset + size
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == end:  # merge with the run after
            end = self._ends[i]
            del self._starts[i], self._ends[i]
        if i > 0 and self._ends[i - 1] == start:  # merge with the run before
            self._ends[i - 1] = end
        else:
            self._starts.insert(i, start)
            self._ends.insert(i, end)

    def used_end(self) -> int:
        """End of the last allocated region (0: none): where an unbounded slab would place more."""
        return max((s + n for s, n in self._used.items()), default=0)

    def largest_free(self) -> int:
        return max((e - s for s, e in zip(self._starts, self._ends)), default=0)


class HostSlab:
    """One preallocated host buffer that saved tensors are offloaded into, in aligned regions.

        slab = HostSlab(nbytes)                  # buffer: uint8 [nbytes], allocated once, here
        off = slab.allocate(n)                   # slab.buffer[off : off + n] is this region
        slab.free(off)
        slab.capacity, slab.in_use, slab.high_water, slab.pinned

    `pin_memory` None pins exactly when torch.cuda.is_available() (page-locked memory is what
    lets device <-> host copies run asynchronously; CPU-only torch cannot pin and raises);
    True without CUDA is a ValueError. allocate raises SlabTooSmallError (nothing allocated)
    when no free run holds the region. Thread-safe (frees may come from autograd's threads).
    """

    def __init__(self, nbytes: int, *, pin_memory: Optional[bool] = None) -> None:
        if not _checks.is_int(nbytes):
            raise TypeError(f"nbytes: expected an int (bytes), got {type(nbytes).__name__}")
        if nbytes < 0:
            raise ValueError(f"nbytes: must be >= 0, got {nbytes}")
        cuda = torch.cuda.is_available()
        if pin_memory and not cuda:
            raise ValueError(
                "pin_memory: True needs CUDA, and torch.cuda.is_available() is False here; pass "
                "None (pins exactly when CUDA is available) or False"
            )
        self.pinned = cuda if pin_memory is None else bool(pin_memory)
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)  # [nbytes]
        self._regions = _FirstFit(nbytes)
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """The slab's size in bytes (`nbytes`)."""
        return self._regions.capacity

    @property
    def in_use(self) -> int:
        """Bytes in allocated regions (each rounded up to ALIGNMENT)."""
        return self._regions.in_use

    @property
    def high_water(self) -> int:
        """The largest region end ever reached: the slab size a replay of the same steps needs."""
        return self._regions.high_water

    def allocate(self, nbytes: int) -> int:
        """Offset of a free region of `nbytes` bytes (rounded up to ALIGNMENT), first fit."""
        with self._lock:
            offset = self._regions.allocate(nbytes)
            if offset is not None:
                return offset
            size = _round_up(nbytes, ALIGNMENT)
            needed = max(self._regions.used_end() + size, self._regions.high_water)
            raise SlabTooSmallError(
                f"HostSlab: no room for a tensor of {nbytes} bytes: {self.in_use} of {self.capacity} bytes in "
                f"use (largest free run {self._regions.largest_free()}); this step needs at least {needed} bytes: "
                f"create HostSlab({needed}) or larger, or let Offloader() size its slab from a profiling step",
                needed,
            )

    def free(self, offset: int) -> None:
        """Make the region at `offset` free again; ValueError when none starts there."""
        with self._lock:
            try:
                self._regions.free(offset)
            except KeyError:
                raise ValueError(f"offset: no allocated region starts at {offset} (freed twice?)") from None

    def __repr__(self) -> str:
        return f"HostSlab({self.capacity}, pinned={self.pinned}, in_use={self.in_use}, high_water={self.high_water})"
