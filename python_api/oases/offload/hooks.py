"""offload_saved_tensors: torch.autograd.graph.save_on_cpu, batched through an Offloader's slab.

    off = Offloader(batch=16)
    with offload_saved_tensors(off):
        loss = model(x)            # what autograd saves leaves the device, `batch` tensors per copy
    loss.backward()                # each comes back, with its batch and the one saved before it,
    off.end_step()                 #   on first use (reverse order of saving assumed)

Parameters (and views of them) and tensors under `min_bytes` stay where they are: autograd keeps
them as it would. A tensor unpacked twice (retain_graph=True) is kept on the device after its
first unpack, as long as the graph holds it.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Iterator, Optional, Union

import torch
import torch.nn as nn

from oases import _checks
from oases.offload.handle import OffloadHandle, OffloadState
from oases.offload.offloader import Offloader

__all__ = ["offload_saved_tensors"]

_COMING_BACK = (OffloadState.IN_FLIGHT_OUT, OffloadState.ON_HOST)


class _Packed:
    """What autograd keeps for one saved tensor: the tensor itself, or an offload handle (and, once
    unpacked, the device tensor)."""

    __slots__ = ("kept", "handle", "position")

    def __init__(self, kept: Optional[torch.Tensor], handle: Optional[OffloadHandle], position: int) -> None:
        self.kept, self.handle, self.position = kept, handle, position


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


@contextlib.contextmanager
def offload_saved_tensors(offloader: Offloader, *, min_bytes: int = 0, ahead: int = 1) -> Iterator[None]:
    """Inside: tensors autograd saves for backward go through `offloader` (module docstring).

    pack(t):   t if parameter or nbytes(t) < min_bytes else offloader.save(t, group=<this context>)
    exit:      offloader.flush(<this context>)
    unpack(p): prefetch p's batch and the `ahead` batches saved before it; offloader.get(p)
    """
    if not isinstance(offloader, Offloader):
        raise TypeError(f"offloader: expected an oases.offload.Offloader, got {type(offloader).__name__}")
    if not _checks.is_int(min_bytes) or min_bytes < 0:
        raise ValueError(f"min_bytes: expected an int >= 0, got {min_bytes!r}")
    if not _checks.is_int(ahead) or ahead < 0:
        raise ValueError(f"ahead: expected an int >= 0, got {ahead!r}")
    group = object()  # this context's saves batch only with each other
    saved: list[weakref.ref] = []  # every handle, in saving order (weak: the graph owns them)
    positions = itertools.count()

    def pack(t: torch.Tensor) -> Union[_Packed, torch.Tensor]:
        if _is_parameter(t) or t.numel() * t.element_size() < min_bytes or t.layout != torch.strided:
            return _Packed(t, None, -1)
        c = offloader.save(t, group=group)
        saved.append(weakref.ref(c))
        return _Packed(None, c, next(positions))

    def unpack(p: _Packed) -> torch.Tensor:
        if p.kept is not None:
            return p.kept
        c = p.handle
        wanted, batches = [], []
        for ref in reversed(saved[: p.position + 1]):  # p's batch, then the ones saved before it
            other = ref()
            if other is None or other.batch is None:
                continue
            if other.batch not in batches:
                if len(batches) == 1 + ahead:
                    break
                batches.append(other.batch)
            if other.state in _COMING_BACK:
                wanted.append(other)
        offloader.prefetch(wanted)
        p.kept = offloader.get(c)
        offloader.release(c)
        p.handle = None
        return p.kept

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        try:
            yield
        finally:
            offloader.flush(group)
