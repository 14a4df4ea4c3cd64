"""The training schedules as the runtime runs them and the planner costs them: one table.

::

    SCHEDULES[name] = Schedule(sub_batches, fine_grained_recompute, pass_barriers)
        megatron     1 program; a layer recomputed whole (its all-reduces again)
        merak        2 sub-batches, held at each pass boundary
        cross_pass   2 sub-batches interleaved across passes
        oases        2 sub-batches, recomputation per sublayer from its input (no all-reduce)

Pure data (no torch): oases.schedule runs it (re-exported there), oases.planner reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from oases.costs.recompute import FULL, KEEP, SELECTIVE

__all__ = ["Schedule", "SCHEDULES"]


@dataclass(frozen=True)
class Schedule:
    """How a training step runs: the batch split along dim 0 into `sub_batches` interleaved
    programs (the default; train_step may override it); recomputation per sublayer from its
    input (no all-reduce) or per layer (all of it); programs held at each pass boundary or not."""

    sub_batches: int
    fine_grained_recompute: bool
    pass_barriers: bool
    recompute: bool = True  # False: each sublayer's graph kept from the forward (train_step(recompute=False))
    selective: bool = False  # with recompute False: the kept graphs save only GEMM and attention outputs
    layers: tuple[str, ...] = ()  # per layer, FULL / KEEP / SELECTIVE (train_step(recompute=[...])); (): as above

    def mode(self, layer: int) -> str:
        """How layer `layer` keeps what its backward needs: FULL (recomputed as the schedule
        recomputes), KEEP (each sublayer's graph kept) or SELECTIVE (kept, GEMM outputs only)."""
        if self.layers:
            return self.layers[layer]
        return FULL if self.recompute else SELECTIVE if self.selective else KEEP


SCHEDULES: Mapping[str, Schedule] = MappingProxyType(
    {
        "megatron": Schedule(sub_batches=1, fine_grained_recompute=False, pass_barriers=False),
        "merak": Schedule(sub_batches=2, fine_grained_recompute=False, pass_barriers=True),
        "cross_pass": Schedule(sub_batches=2, fine_grained_recompute=False, pass_barriers=False),
        "oases": Schedule(sub_batches=2, fine_grained_recompute=True, pass_barriers=False),
    }
)
