"""Batched offload of saved tensors (a schedule's recompute inputs, autograd's saved tensors) to one
preallocated host buffer (FOLD3D §4).

::

    HostSlab              the host buffer: preallocated, pinned on CUDA, first-fit aligned regions
    CopyEngine            batched copies of many tensors to/from slab offsets, one call, on a copy
                          stream of its own (oases._C, or a Python fallback)
    Offloader             saved tensors out in batches, back in use order; an OffloadHandle per
                          saved tensor, its OffloadState where its bytes are
    OffloadStack          a schedule's push/pop of sublayer inputs through an Offloader
    offload_saved_tensors torch.autograd.graph.save_on_cpu, batched through an Offloader

The schedules drive it directly: `oases.train_step(..., offload=True)`,
`oases.models.GPT(config, group, offload=True)`.

Old names, deprecated (they warn and return the new object): `Checkpoint` (now `OffloadHandle`),
`CheckpointState` (`OffloadState`), `CheckpointStack` (`OffloadStack`); `OffloadStats.checkpoints`
is `OffloadStats.saves`. "Checkpoint" is a training state saved to files (`oases.checkpoint`).
"""

import warnings
from types import MappingProxyType

from oases.offload.engine import CopyEngine, CopyEvent
from oases.offload.handle import OffloadHandle, OffloadState
from oases.offload.hooks import offload_saved_tensors
from oases.offload.lifo import OffloadStack
from oases.offload.offloader import Offloader, OffloadStats
from oases.offload.slab import ALIGNMENT, HostSlab, SlabTooSmallError

__all__ = [
    "HostSlab",
    "SlabTooSmallError",
    "ALIGNMENT",
    "CopyEngine",
    "CopyEvent",
    "Offloader",
    "OffloadHandle",
    "OffloadState",
    "OffloadStats",
    "OffloadStack",
    "offload_saved_tensors",
]

_DEPRECATED = MappingProxyType(
    {"Checkpoint": "OffloadHandle", "CheckpointState": "OffloadState", "CheckpointStack": "OffloadStack"}
)


def __getattr__(name: str) -> object:
    """The old names (PEP 562): warn, and return the object under its new name."""
    new = _DEPRECATED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"oases.offload.{name} is deprecated: use oases.offload.{new}", DeprecationWarning, stacklevel=2)
    return globals()[new]
