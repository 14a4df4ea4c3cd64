"""Per-layer TP degrees: layer l of a stack sharded over d_l ranks of a TP group of p, as p / d_l replicas.

Shared by oases.models.GPT(tp_degrees=...) and oases.parallelize(model, group, tp_degrees=...),
each of which builds one LayerDegrees and keeps it on the model (`model.layer_degrees`); the
schedules read it (oases.schedule.placed).

    plan         LayerDegrees: the degrees, this rank's placements and row groups, the replica-sum switch
    checks       check_tp_degrees (one power of two dividing p per layer), check_world_group, and
                 refuse_with_degrees (the options that do not combine with per-layer degrees)
    decoder      the decoder layers a per-layer plan applies to (KNOWN_LAYERS, or a dotted path)
    placements   Placement (where a layer of degree d runs on this rank), RowGroup, make_placements
    rows         RowsDown / RowsUp (the resharding autograd functions), reshard_rows
    hooks        decoder layers run at their degrees by hooks; the replica-gradient sums (ReplicaSums)
"""

from oases.degrees.checks import check_tp_degrees, check_world_group, refuse_with_degrees
from oases.degrees.decoder import KNOWN_LAYERS, find_decoder_layers, find_layer_degrees
from oases.degrees.hooks import ReplicaSums, hook_decoder_layers, hook_replica_sums, kwargs_rows, sum_over_replicas
from oases.degrees.placements import Placement, RowGroup, RowGroups, make_placements
from oases.degrees.plan import LayerDegrees
from oases.degrees.rows import RowsDown, RowsUp, reshard_rows

__all__ = [
    "KNOWN_LAYERS",
    "LayerDegrees",
    "Placement",
    "ReplicaSums",
    "RowGroup",
    "RowGroups",
    "RowsDown",
    "RowsUp",
    "check_tp_degrees",
    "check_world_group",
    "find_decoder_layers",
    "find_layer_degrees",
    "refuse_with_degrees",
    "hook_decoder_layers",
    "hook_replica_sums",
    "kwargs_rows",
    "make_placements",
    "reshard_rows",
    "sum_over_replicas",
]
