"""Ring collectives built from point-to-point ops (gloo and NCCL alike), and TP process groups.

`all_gather_steps` / `reduce_scatter_steps` are the same rings as generators that yield between
ring steps (the schedules interleave other work there)."""
from oases.comm.groups import new_group
from oases.comm.ring import all_gather_steps, all_reduce, reduce_scatter_steps, ring_all_gather, ring_reduce_scatter

__all__ = ["ring_all_gather", "ring_reduce_scatter", "all_reduce", "all_gather_steps", "reduce_scatter_steps",
           "new_group"]
