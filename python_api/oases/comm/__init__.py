"""Ring collectives built from point-to-point ops (gloo and NCCL alike), and TP process groups.

`all_gather_steps` / `reduce_scatter_steps` are the same rings as generators that yield between
ring steps (the schedules interleave other work there); `all_gather_rows` / `reduce_scatter_rows`
yield row slices as they become valid or are consumed (the fused ops compute on them).
`oases.comm.hierarchical`: the same collectives in two levels over emulated or real hosts
(`HostGroups`), and `planned_*` forms that pick flat or hierarchical by
oases.costs.collectives.partition."""

from oases.comm.groups import new_group
from oases.comm.hierarchical import (
    HostGroups,
    HostLinks,
    hierarchical_all_gather,
    hierarchical_all_reduce,
    hierarchical_reduce_scatter,
    planned_all_gather,
    planned_all_reduce,
    planned_form,
    planned_reduce_scatter,
)
from oases.comm.ring import (
    all_gather_rows,
    all_gather_steps,
    all_reduce,
    reduce_scatter_rows,
    reduce_scatter_steps,
    ring_all_gather,
    ring_reduce_scatter,
)

__all__ = [
    "ring_all_gather",
    "ring_reduce_scatter",
    "all_reduce",
    "all_gather_steps",
    "reduce_scatter_steps",
    "all_gather_rows",
    "reduce_scatter_rows",
    "new_group",
    "HostGroups",
    "HostLinks",
    "hierarchical_all_gather",
    "hierarchical_reduce_scatter",
    "hierarchical_all_reduce",
    "planned_all_gather",
    "planned_reduce_scatter",
    "planned_all_reduce",
    "planned_form",
]
