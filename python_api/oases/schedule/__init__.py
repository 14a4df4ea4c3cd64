"""Training schedules for TP transformer stacks: megatron, merak, cross_pass, oases.

A model reaches them by implementing `Stack` (oases.schedule.protocol); `oases.train_step` finds
or builds that for a parallelized model and calls `train_step` here.

    oases.schedule.table              the schedules (SCHEDULES), checks, recomputation memory
    oases.schedule.programs           one sub-batch's program (recompute per sublayer or per layer)
    oases.schedule.selective          recompute="selective": kept graphs that save only GEMM outputs
    oases.schedule.sequence_parallel  the same with the sequence split over the TP ranks
    oases.schedule.placed             per-layer TP degrees: row moves, replica gradient sums
    oases.schedule.options            StepOptions: a step's options, checked once (StepBatch)
    oases.schedule.step               train_step / run_step: the programs interleaved
    oases.schedule.runtime            Communicator and interleave; .exposure: waits by cause

`CheckpointMemory`, the old name of `RecomputeMemory`, warns and returns it (a checkpoint is a
training state saved to files: oases.storage).
"""

from oases._deprecated import renamed as _renamed
from oases.schedule.options import StepBatch, StepOptions
from oases.schedule.protocol import EmbedSplit, HeadSplit, Stack, SubBatch, Sublayer
from oases.schedule.runtime import BARRIER, Communicator, interleave
from oases.schedule.step import check_placed, run_step, train_step
from oases.schedule.table import (
    MAX_SUB_BATCHES,
    SCHEDULES,
    Recompute,
    RecomputeMemory,
    Schedule,
    check_step,
    split_rows,
)

__all__ = [
    "SCHEDULES",
    "Schedule",
    "MAX_SUB_BATCHES",
    "RecomputeMemory",
    "Recompute",
    "train_step",
    "run_step",
    "check_placed",
    "StepOptions",
    "StepBatch",
    "check_step",
    "split_rows",
    "Stack",
    "Sublayer",
    "SubBatch",
    "EmbedSplit",
    "HeadSplit",
    "Communicator",
    "interleave",
    "BARRIER",
]


__getattr__ = _renamed(__name__, {"CheckpointMemory": "RecomputeMemory"}, globals())  # the old name warns
