"""Where this rank sits in a process group's ring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Ring:
    """A process group seen as a ring: rank r sends to r+1 and receives from r-1 (mod size)."""

    group: Optional[dist.ProcessGroup]
    rank: int  # this rank's index in the group
    size: int
    global_ranks: tuple[int, ...]

    def peer(self, step: int) -> int:
        """Global rank of the group member `step` places along the ring (negative: backwards)."""
        return self.global_ranks[(self.rank + step) % self.size]


def process_group(group: object, name: str = "group") -> Optional[dist.ProcessGroup]:
    """The process group an argument names: a 1-D DeviceMesh's (as torch's parallelize_module
    takes `mesh["tp"]`), else the argument itself (a ProcessGroup, or None: the world).

    Raises ValueError for a DeviceMesh of several dimensions, naming them."""
    if not isinstance(group, DeviceMesh):
        return group  # type: ignore[return-value]
    if group.ndim != 1:
        names = group.mesh_dim_names or tuple(range(group.ndim))
        raise ValueError(
            f"{name}: a {group.ndim}-D DeviceMesh (dimensions {names}); pass the one dimension this group "
            f"spans, e.g. mesh[{names[-1]!r}]"
        )
    return group.get_group()


def ring_of(group: Optional[dist.ProcessGroup]) -> Ring:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group() "
            "(or run under torchrun / oases-launch) before using oases collectives"
        )
    group = process_group(group)
    if group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return Ring(group, rank, dist.get_world_size(group), tuple(dist.get_process_group_ranks(group)))


def same_group(a: Optional[dist.ProcessGroup], b: Optional[dist.ProcessGroup]) -> bool:
    """Whether two group arguments name the same group (None: the world)."""
    if not dist.is_initialized():
        return True
    world = dist.group.WORLD
    return (a or world) is (b or world)
