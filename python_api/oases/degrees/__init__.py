"""Per-layer TP degrees: layer l of a stack sharded over d_l ranks of a TP group of p, as p / d_l replicas.

Shared by oases.models.GPT(tp_degrees=...) and oases.parallelize(model, group, tp_degrees=...);
the schedules read the placements (oases.schedule.placed).

    checks       check_tp_degrees: one power of two dividing p per layer
    placements   Placement (where a layer of degree d runs on this rank), RowGroup, make_placements
    rows         RowsDown / RowsUp (the resharding autograd functions), reshard_rows
    hooks        decoder layers run at their degrees by hooks; the replica-gradient sums
"""
from oases.degrees.checks import check_tp_degrees
from oases.degrees.hooks import (
    DegreeGroups,
    hook_decoder_layers,
    kwargs_rows,
    sum_over_replicas,
    sum_over_replicas_while,
)
from oases.degrees.placements import Placement, RowGroup, RowGroups, make_placements
from oases.degrees.rows import RowsDown, RowsUp, reshard_rows

__all__ = ["DegreeGroups", "Placement", "RowGroup", "RowGroups", "RowsDown", "RowsUp", "check_tp_degrees",
           "hook_decoder_layers", "kwargs_rows", "make_placements", "reshard_rows", "sum_over_replicas",
           "sum_over_replicas_while"]
