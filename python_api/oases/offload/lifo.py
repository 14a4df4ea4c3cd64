"""OffloadStack: one program's saved tensors (its recompute inputs), pushed in forward and popped
in reverse in backward (the use order of a layer stack), offloaded in batches and prefetched ahead
of their use.

    saved = OffloadStack(offloader, group=k)        # k: the sub-batch (or micro-batch)
    saved.push(x)          # forward: every `batch` pushes leave the device in one copy
    saved.flush()          # forward done: the last (partial) batch too; the first batch the
                           # backward needs starts coming back (overlapping the loss and the head)
    x = saved.pop()        # backward: the newest; its batch and `ahead` more are on their way in

    forward (batch 2):   push c0 c1 | c2 c3 | c4        flush
    copies out:                 [c0 c1] [c2 c3]  [c4]
    backward:            pop c4 | c3 c2 | c1 c0
    copies in:          [c4] [c3 c2]  [c1 c0]            ([c4] at flush, then each `ahead` batches early)

Copies per step = ceil(pushes / batch) out, as many in. A popped tensor is released from the
offloader at once: the caller holds the only reference.
"""

from __future__ import annotations

from typing import Hashable, Optional

import torch

from oases import _checks
from oases._deprecated import renamed as _renamed
from oases.offload.handle import OffloadHandle, OffloadState
from oases.offload.offloader import Offloader

__all__ = ["OffloadStack"]

_COMING_BACK = (OffloadState.IN_FLIGHT_OUT, OffloadState.ON_HOST)


class OffloadStack:
    """LIFO of one group's saved tensors in an Offloader (see the module docstring).

    ahead: batches prefetched beyond the one in use (0: a batch is fetched at its first pop).
    """

    def __init__(self, offloader: Offloader, group: Hashable, *, ahead: int = 1) -> None:
        if not isinstance(offloader, Offloader):
            raise TypeError(f"offloader: expected an oases.offload.Offloader, got {type(offloader).__name__}")
        if not _checks.is_int(ahead) or ahead < 0:
            raise ValueError(f"ahead: expected an int >= 0 (batches prefetched early), got {ahead!r}")
        self.offloader, self.group, self.ahead = offloader, group, ahead
        self._items: list[OffloadHandle] = []

    def __len__(self) -> int:
        return len(self._items)

    def push(self, t: torch.Tensor) -> None:
        """Save `t` in the offloader under this stack's group (it leaves with its batch)."""
        self._items.append(self.offloader.save(t, group=self.group))

    def flush(self) -> None:
        """Offload what is still on the device, then start bringing back the first batch used (the
        ones after it follow as the pops begin)."""
        self.offloader.flush(self.group)
        self._prefetch_ahead(0)

    def pop(self) -> torch.Tensor:
        """The newest saved tensor on its device, released from the offloader; its batch and
        `ahead` more are prefetched first."""
        c = self._items.pop()
        self._items.append(c)  # keep c in view while its own batch is prefetched
        self._prefetch_ahead()
        self._items.pop()
        t = self.offloader.get(c)
        self.offloader.release(c)
        return t

    def _prefetch_ahead(self, ahead: Optional[int] = None) -> None:
        """Prefetch the next 1 + ahead distinct batches in use order (newest first)."""
        ahead = self.ahead if ahead is None else ahead
        batches: list[int] = []
        wanted: list[OffloadHandle] = []
        for c in reversed(self._items):
            b = c.batch
            if b is None:
                continue  # never offloaded: still on the device
            if b not in batches:
                if len(batches) == 1 + ahead:
                    break
                batches.append(b)
            if c.state in _COMING_BACK:
                wanted.append(c)
        if wanted:
            self.offloader.prefetch(wanted)


__getattr__ = _renamed(
    __name__, {"CheckpointStack": "OffloadStack"}, globals(), public="oases.offload"
)  # the old names warn
