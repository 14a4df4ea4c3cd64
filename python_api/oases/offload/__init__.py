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
is `OffloadStats.saves`. "Checkpoint" is a training state saved to files (`oases.storage`).
"""

from oases._deprecated import renamed as _renamed
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

# the old names (a checkpoint is a training state saved to files): they warn
__getattr__ = _renamed(
    __name__,
    {"Checkpoint": "OffloadHandle", "CheckpointState": "OffloadState", "CheckpointStack": "OffloadStack"},
    globals(),
)
