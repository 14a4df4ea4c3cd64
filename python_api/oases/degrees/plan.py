"""A model's per-layer TP degrees as one frozen object, built once and read by everything that runs it.

    degrees = LayerDegrees.make(group, p, rank, (d_0, ..., d_{L-1}))   # collective over the world
    degrees.placement(l)              where layer l runs on this rank (its replica's TP and replica groups)
    degrees.reshard_rows(x, a, b, B)  x's rows of a batch of B rows, from degree a's blocks to degree b's
    degrees.hook_replica_sums(layers) each layer of degree < p: its gradients summed over its replicas
    with degrees.replica_sums_suspended():   a schedule that sums them itself (oases.train_step)
        ...

oases.models.GPT(tp_degrees=...) keeps it as `model.layer_degrees`; oases.parallelize(model,
tp_degrees=...) sets `model.layer_degrees` (and `model.tp_degrees`, its degrees) on the model it
shards. The schedules read it (oases.schedule.placed.layer_placements) through the model's
`layer_placements()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from oases._checks import process_group
from oases.degrees.checks import check_batch_rows
from oases.degrees.hooks import ReplicaSums, hook_decoder_layers, hook_replica_sums
from oases.degrees.placements import Placement, RowGroups, make_placements
from oases.degrees.rows import reshard_rows

__all__ = ["LayerDegrees"]


@dataclass(frozen=True, eq=False)
class LayerDegrees:
    """The per-layer TP degrees of a model's decoder layers over a TP group of `p` ranks.

    degrees: one per layer, each a power of two dividing p (oases.degrees.check_tp_degrees);
    placements: {degree: this rank's Placement at that degree}; row_groups: {(lo, hi): this rank's
    RowGroup moving rows between neighbouring degrees lo < hi}; where: how the layers are named in
    messages (parallelize: their dotted path). `replica_sums` is the one mutable part: the switch
    of the replica-sum hooks (`replica_sums_suspended()`). Made by `make`, collectively.
    """

    degrees: tuple[int, ...]
    p: int
    placements: dict[int, Placement]
    row_groups: RowGroups
    where: str = "layers"
    replica_sums: ReplicaSums = field(default_factory=ReplicaSums, repr=False)

    @classmethod
    def make(
        cls, group: Optional[dist.ProcessGroup], p: int, rank: int, degrees: Sequence[int], *, where: str = "layers"
    ) -> "LayerDegrees":
        """The degrees' placements and row groups for this rank (`rank` of `group`'s `p`): collective
        on every rank of the world, in the same order (oases.degrees.make_placements). `degrees`
        must have been checked (check_tp_degrees)."""
        degrees = tuple(degrees)
        placements, row_groups = make_placements(process_group(group), p, rank, degrees)
        return cls(degrees, p, placements, row_groups, where)

    def placement(self, index: int) -> Placement:
        """Where layer `index` runs on this rank."""
        return self.placements[self.degrees[index]]

    def check_rows(self, what: str, batch: int) -> None:
        """ValueError unless a batch of `batch` rows gives every replica a row (oases.degrees.check_batch_rows)."""
        check_batch_rows(what, batch, self.degrees, self.p)

    def reshard_rows(self, x: torch.Tensor, a: int, b: int, batch: int) -> torch.Tensor:
        """x, this rank's replica's rows of a batch of `batch` rows at degree a -> its rows at degree
        b (oases.degrees.reshard_rows; the identity when a == b)."""
        return reshard_rows(x, a, b, self.row_groups, batch)

    def hook_replica_sums(self, layers: Sequence[nn.Module]) -> list:
        """Each layer of degree < p: its parameter gradients summed over its replicas by hooks, while
        the switch is on (oases.degrees.hook_replica_sums); returns the handles."""
        return hook_replica_sums(layers, self.degrees, self.placements, self.replica_sums)

    def hook_layers(self, layers: Sequence[nn.Module]) -> list:
        """Decoder layers called as layer(x, ...) run at their degrees by hooks (rows resharded and
        cut: oases.degrees.hook_decoder_layers); returns the handles."""
        return hook_decoder_layers(layers, self.degrees, self.p, self.placements, self.row_groups, where=self.where)

    def replica_sums_suspended(self) -> ContextManager[None]:
        """Inside, the replica-sum hooks stand down (a schedule sums each layer's gradients itself)."""
        return self.replica_sums.suspended()
