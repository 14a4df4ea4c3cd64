"""Batched offload of activation checkpoints to one preallocated host buffer (FOLD3D §4).

::

    HostSlab              the host buffer: preallocated, pinned on CUDA, first-fit aligned regions
    CopyEngine            batched copies of many tensors to/from slab offsets, one call, on a copy
                          stream of its own (oases._C, or a Python fallback)
    Offloader             checkpoints out in batches, back in use order; a state per checkpoint
    CheckpointStack       a schedule's push/pop of sublayer inputs through an Offloader
    offload_saved_tensors torch.autograd.graph.save_on_cpu, batched through an Offloader

The schedules drive it directly: `oases.train_step(..., offload=True)`,
`oases.models.GPT(config, group, offload=True)`.
"""
from oases.offload.engine import CopyEngine, CopyEvent
from oases.offload.hooks import offload_saved_tensors
from oases.offload.lifo import CheckpointStack
from oases.offload.offloader import Checkpoint, CheckpointState, Offloader, OffloadStats
from oases.offload.slab import ALIGNMENT, HostSlab, SlabTooSmallError

__all__ = ["HostSlab", "SlabTooSmallError", "ALIGNMENT", "CopyEngine", "CopyEvent", "Offloader", "Checkpoint",
           "CheckpointState", "OffloadStats", "CheckpointStack", "offload_saved_tensors"]
