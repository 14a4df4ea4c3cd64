"""segments="auto" and dp_overlap_ratio="auto": the times a Pipeline measures on its first train_step's
batch, and FOLD3D's rules (oases.planner.fold3d: choose_segments, dp_overlap_ratio) applied to them.

    forward_s, backward_s = one layer's forward / backward (with recomputation) on micro-batch 0,
                            times this stage's layers (MAX over ranks)
    dp_comm_s  = this stage's gradient sync over dp (a ring all-reduce of one bucket, scaled)
    pp_comm_s  = one activation between neighbouring stages (a ring exchange over pp)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from oases.pipeline._config import Settings
from oases.pipeline.dp_sync import SegmentSync
from oases.pipeline.p2p import StageComm
from oases.pipeline.stages import Stage
from oases.planner.fold3d import choose_segments, dp_overlap_ratio
from oases.schedule import SubBatch

if TYPE_CHECKING:
    from oases.pipeline._execute import Step

__all__ = ["retune", "measure", "choose"]


def retune(
    step: Step,
    stage: Stage,
    sync: SegmentSync,
    comm: StageComm,
    settings: Settings,
    *,
    ratio: float,
    auto: dict[str, bool],
) -> tuple[dict[str, float], tuple[int, float]]:
    """(the times measured on the step's largest micro-batch, (segments, dp_overlap_ratio) chosen from
    them for the `auto` arguments, the others kept: stage.layout's segments, `ratio`): what a Pipeline's
    first train_step reconfigures by (`settings`: its micro_batches)."""
    layout = stage.layout
    # the largest micro-batch (split_rows puts the larger ones last), as before the split was shared
    measured = measure(
        stage,
        sync,
        comm,
        step.micro[-1][0],
        step.shapes[-1],
        step.dtype,
        layout.layers // layout.stages,
        where=step.where(len(step.micro) - 1),
    )
    chosen = choose(
        measured,
        layers=layout.layers,
        pp=layout.stages,
        micro_batches=settings.micro_batches,
        segments=layout.segments,
        ratio=ratio,
        auto=auto,
        shared_at=stage.shared_at,
    )
    return measured, chosen


def measure(
    stage: Stage,
    sync: SegmentSync,
    comm: StageComm,
    tokens: torch.Tensor,
    shape: torch.Size,
    dtype: torch.dtype,
    layers_per_stage: int,
    *,
    where: Optional[SubBatch] = None,
) -> dict[str, float]:
    """The times of the module doc, on micro-batch `tokens` (activations [shape] of `dtype`; `where`:
    its SubBatch, whose dropout seed keeps the timed layers' draws off the default generator; None:
    all its rows, no seed); the same on every rank (a MAX all-reduce over the world)."""
    where = SubBatch(slice(0, tokens.shape[0]), tokens.shape[0]) if where is None else where
    _, ctx = stage.embed(tokens, where)
    forward, backward = stage.time_layer(shape, dtype, ctx)
    numel = sum(p.numel() for p in stage.parameters())
    times = torch.tensor(
        [
            forward * layers_per_stage,
            backward * layers_per_stage,
            sync.time_sync(numel),
            comm.time_transfer(shape, dtype),
        ],
        dtype=torch.float64,
        device=comm.device,
    )
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # every rank decides the same
    f, b, dp_s, pp_s = times.tolist()
    return dict(forward_s=f, backward_s=b, dp_comm_s=dp_s, pp_comm_s=pp_s)


def choose(
    measured: dict[str, float],
    *,
    layers: int,
    pp: int,
    micro_batches: int,
    segments: int,
    ratio: float,
    auto: dict[str, bool],
    shared_at: Callable[[int], Optional[str]],
) -> tuple[int, float]:
    """(segments, dp_overlap_ratio): those `auto` marks chosen by FOLD3D's rules from `measured`, the
    others kept; the segment count kept when it would split a weight tied between layers (`shared_at`)."""
    f, b = measured["forward_s"], measured["backward_s"]
    dp_s, pp_s = measured["dp_comm_s"], measured["pp_comm_s"]
    chosen = segments
    if auto["segments"]:
        chosen = choose_segments(layers, pp, f, b, pp_s, dp_s, micro_batches=micro_batches)
    if shared_at(chosen):  # a weight tied between layers must stay in one segment
        chosen = segments
    if auto["dp_overlap_ratio"]:
        ratio = dp_overlap_ratio(f, b, dp_s, segments=chosen, micro_batches=micro_batches)
    return chosen, ratio
