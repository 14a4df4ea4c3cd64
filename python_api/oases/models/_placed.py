"""LayerPlacements (oases.schedule.protocol) from a model's per-layer degree groups.

Shared by oases.models.GPT and the Hugging Face adapter (oases.models.HFStack): both keep an
oases.degrees.DegreeGroups (this rank's Placement per degree, the resharding groups, the
switch of the replica-sum hooks) and hand the schedules the same thing:

    for layer l at degree d:  LayerPlacement(d, Communicator(tp group of d), replica, replicas,
                                             rows_in = RowMove(d_{l-1} -> d), Communicator(replica group),
                                             layer's parameters)
    rows_out = RowMove(d_{L-1} -> p);  while_scheduled: the replica-sum hooks stand down
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch.nn as nn

from oases.degrees import DegreeGroups
from oases.schedule.protocol import LayerPlacement, LayerPlacements, RowMove
from oases.schedule.runtime import Communicator


def layer_placements(groups: DegreeGroups, degrees: Sequence[int], layers: Sequence[nn.Module], p: int, *,
                     comm_at_p: Optional[Communicator] = None) -> LayerPlacements:
    """The placements of `layers` (one per degree) over a group of `p` ranks; their Communicators
    are made here, once (`comm_at_p`: the one to reuse at degree p, e.g. the model's own)."""
    comms = {d: comm_at_p if d == p and comm_at_p is not None else Communicator(at.tp_group if d > 1 else None, d)
             for d, at in groups.placements.items()}
    replica_comms = {d: Communicator(at.replica_group, at.replicas) for d, at in groups.placements.items()
                     if at.replica_group is not None}
    ups: dict[tuple[int, int], RowMove] = {}  # one Communicator per pair of neighbouring degrees

    def move(a: int, b: int) -> Optional[RowMove]:  # rows of degree a -> those of degree b
        if a == b:
            return None
        lo, hi = min(a, b), max(a, b)
        if (lo, hi) not in ups:
            at = groups.row_groups[lo, hi]
            ups[lo, hi] = RowMove(Communicator(at.group, at.parts), False, at.parts, at.index, at.replica, at.replicas)
        up = ups[lo, hi]
        return RowMove(up.comm, b < a, up.parts, up.index, up.replica, up.replicas)

    @contextlib.contextmanager
    def scheduled() -> Iterator[None]:  # the schedule sums the replicas: the hooks stand down
        previous, groups.sums_on[0] = groups.sums_on[0], False
        try:
            yield
        finally:
            groups.sums_on[0] = previous

    placed, previous = [], p
    for d, layer in zip(degrees, layers):
        at = groups.placements[d]
        placed.append(LayerPlacement(d, comms[d], at.replica, at.replicas, move(previous, d), replica_comms.get(d),
                                     tuple(layer.parameters())))
        previous = d
    return LayerPlacements(tuple(placed), move(previous, p), scheduled)
