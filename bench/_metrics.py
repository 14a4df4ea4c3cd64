"""The derived figures every suite reports, as pure functions of measured times.

bound      = max(t_compute, t_comm)                         the best any overlap can do
efficiency = (t_serial - t_overlap) / (t_serial - bound)    1: all of the hideable part hidden
                                                            0: nothing hidden; < 0: slower
speedup    = t_peer / t_ours
bus bandwidth (nccl-tests' convention, comparable across world sizes p):
    all-gather, reduce-scatter: (bytes of the full tensor / t) * (p - 1) / p
    all-reduce:                 (bytes of the tensor / t) * 2 (p - 1) / p
ring bytes: what each rank sends for a collective by ring (as oases.schedule.Communicator
    counts it): all-reduce 2 (p - 1) / p n, all-gather / reduce-scatter (p - 1) / p n, n the full tensor
"""

from __future__ import annotations

from typing import Optional

# Below this share of t_serial, serial - bound is within run-to-run noise (±5% per figure on a
# shared CPU machine), and the ratio swings wildly (a 3 ms error on 6 ms hideable is ±0.5):
# efficiency is then undefined (None).
MIN_HIDEABLE = 0.10


def bound(t_compute: float, t_comm: float) -> float:
    return max(t_compute, t_comm)


def efficiency(t_serial: float, t_overlap: float, t_bound: float) -> Optional[float]:
    """Overlap efficiency, or None when serial ≈ bound (nothing to hide, the ratio is noise)."""
    hideable = t_serial - t_bound
    if hideable <= MIN_HIDEABLE * t_serial:
        return None
    return (t_serial - t_overlap) / hideable


def speedup(t_peer: Optional[float], t_ours: float) -> Optional[float]:
    return None if t_peer is None or t_ours <= 0 else t_peer / t_ours


def bus_bandwidth(collective: str, nbytes: int, seconds: float, world_size: int) -> float:
    """Bytes/s on the bus; `nbytes` is the full (gathered / unscattered / reduced) tensor."""
    factor = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}[collective]
    return nbytes / seconds * factor * (world_size - 1) / world_size


def ring_bytes(collective: str, nbytes: int, world_size: int) -> float:
    """Bytes each rank sends for `collective` on a full tensor of `nbytes`, by ring."""
    share = 2.0 if collective.startswith("all_reduce") else 1.0
    return share * (world_size - 1) / world_size * nbytes


def chunk_counts(world_size: int, divides: int) -> list[int]:
    """The sweep 1, 2, p, 2p, 4p: deduplicated, ascending, only counts dividing `divides`."""
    wanted = {1, 2, world_size, 2 * world_size, 4 * world_size}
    return sorted(c for c in wanted if divides % c == 0)
