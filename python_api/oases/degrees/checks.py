"""The local checks of per-layer TP degrees (no communication, the same on every rank)."""
from __future__ import annotations

from typing import Sequence

from oases import _checks

__all__ = ["check_tp_degrees"]


def check_tp_degrees(tp_degrees: object, layers: int, p: int) -> tuple[int, ...]:
    """The degrees as a tuple, or ValueError / TypeError (local checks: the same on every rank)."""
    if isinstance(tp_degrees, (str, bytes)) or not isinstance(tp_degrees, Sequence):
        raise TypeError(f"tp_degrees: expected a list of ints (one TP degree per layer, e.g. oases.plan.load(path)), "
                        f"got {type(tp_degrees).__name__}")
    degrees = tuple(tp_degrees)
    if len(degrees) != layers:
        raise ValueError(f"tp_degrees: expected one degree per layer ({layers}), got {len(degrees)}: {list(degrees)}")
    for i, d in enumerate(degrees):
        if not _checks.is_int(d):
            raise TypeError(f"tp_degrees[{i}]: expected an int, got {type(d).__name__}")
        if d < 1 or d & (d - 1) or p % d:
            raise ValueError(f"tp_degrees[{i}]: {d} is not a power of two dividing the group size {p} "
                             f"(allowed: {[2 ** k for k in range(p.bit_length()) if p % 2 ** k == 0]})")
    return degrees
