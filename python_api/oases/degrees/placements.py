"""Where a layer of TP degree d runs on this rank, and the groups that move rows between degrees.

Ranks are positions 0..p-1 in the model's group. At degree d, rank r is TP rank r % d of replica
r // d, which holds row block r // d of the batch's p / d blocks ("data parallel inside the group";
oases._rows.block_rows: sizes differ by at most one when p / d does not divide B). The blocks nest
(block j at degree hi is blocks j hi/lo .. (j + 1) hi/lo - 1 at degree lo < hi), so each move of
rows between two degrees stays inside one replica of the higher degree (a RowGroup).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from oases import comm as _comm
from oases._rows import block_rows, part_sizes

__all__ = ["Placement", "RowGroup", "RowGroups", "make_placements"]


@dataclass(frozen=True)
class Placement:
    """Where this rank runs a block of TP degree `degree` (of a group of p ranks)."""

    degree: int
    tp_group: Optional[dist.ProcessGroup]  # the replica's `degree` consecutive ranks
    replica_group: Optional[dist.ProcessGroup]  # the p / degree ranks at this TP position; None at degree p
    replica: int  # this rank's replica: rank // degree
    replicas: int  # p // degree

    def rows(self, batch: int) -> slice:
        """This replica's rows of a batch of `batch` rows (oases._rows.block_rows)."""
        return block_rows(batch, self.replicas, self.replica)


@dataclass(frozen=True)
class RowGroup:
    """The ranks that move rows between degrees lo < hi: the `parts` = hi / lo ranks of this rank's
    replica `replica` (of `replicas` = p / hi) at degree hi that share its TP position at degree lo.
    Each holds one lo replica's block of the hi replica's rows; this rank part `index`."""

    group: Optional[dist.ProcessGroup]
    parts: int
    index: int
    replica: int
    replicas: int

    def sizes(self, batch: int) -> tuple[int, ...]:
        """The row counts of the parts, for a batch of `batch` rows (oases._rows.part_sizes)."""
        return part_sizes(batch, self.replicas, self.replica, self.parts)


# {(lo, hi): the RowGroup of this rank resharding rows between degrees lo < hi}
RowGroups = dict[tuple[int, int], RowGroup]


def make_placements(
    group: Optional[dist.ProcessGroup], p: int, me: int, degrees: tuple[int, ...]
) -> tuple[dict[int, Placement], RowGroups]:
    """({degree: this rank's Placement}, {(lo, hi): this rank's RowGroup between degrees lo < hi}).

    Collective on every rank of the world (group == the world), in the same order everywhere:
    for each degree d < p, the replicas' TP groups and the same-position groups; for each pair of
    neighbouring degrees lo < hi (the embedding and head count as degree p), the groups of the
    hi / lo ranks {r: r // hi, r % lo fixed}. A rank list made before is reused (so is `group`)."""
    ranks = dist.get_process_group_ranks(group) if p > 1 else [0]
    made: dict[tuple[int, ...], Optional[dist.ProcessGroup]] = {tuple(range(p)): group}

    def make(members: list[int]) -> None:  # every rank makes every group (non-members get a placeholder)
        if tuple(members) not in made:
            made[tuple(members)] = _comm.new_group([ranks[m] for m in members])

    def own(members: range) -> Optional[dist.ProcessGroup]:  # a group this rank is in
        return made[tuple(members)]

    for d in sorted(set(degrees)):
        for j in range(p // d):
            make(list(range(j * d, (j + 1) * d)))
        for t in range(d):
            make(list(range(t, p, d)))
    edges = sorted({tuple(sorted(pair)) for pair in zip((p, *degrees), (*degrees, p)) if pair[0] != pair[1]})
    for lo, hi in edges:
        for j in range(p // hi):
            for t in range(lo):
                make([j * hi + t + k * lo for k in range(hi // lo)])
    placements = {}
    for d in set(degrees):
        j = me // d
        placements[d] = Placement(
            d, own(range(j * d, (j + 1) * d)), None if d == p else own(range(me % d, p, d)), j, p // d
        )
    rows = {}
    for lo, hi in edges:
        base = (me // hi) * hi + me % lo
        rows[lo, hi] = RowGroup(own(range(base, base + hi, lo)), hi // lo, (me % hi) // lo, me // hi, p // hi)
    return placements, rows
