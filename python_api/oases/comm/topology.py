"""Where this rank sits in a process group's ring (public: the layers, ops, checkpoints and DP sync use it).

ring = ring_of(group)            # group None: the default (WORLD) group
ring.rank, ring.size             # this rank's index in the group, the group's size
ring.global_ranks                # the group's members as global ranks, in group order
ring.peer(+1), ring.peer(-1)     # the global rank after / before this one on the ring
same_group(a, b)                 # a and b are the same group (None meaning WORLD)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from oases._checks import process_group

__all__ = ["Ring", "ring_of", "same_group"]


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


def ring_of(group: Optional[dist.ProcessGroup]) -> Ring:
    """The Ring of `group` (None: WORLD); RuntimeError before init_process_group, ValueError off the group."""
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
