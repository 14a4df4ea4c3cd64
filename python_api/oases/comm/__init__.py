"""Ring collectives built from point-to-point ops (gloo and NCCL alike), and TP process groups."""
from oases.comm.groups import new_group
from oases.comm.ring import all_reduce, ring_all_gather, ring_reduce_scatter

__all__ = ["ring_all_gather", "ring_reduce_scatter", "all_reduce", "new_group"]
