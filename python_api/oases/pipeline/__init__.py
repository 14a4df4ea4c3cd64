"""Pipeline parallelism: stages, segments, schedules, on a (dp, pp, tp) device mesh.

::

    oases.pipeline.Pipeline     train a GPT or any oases.train_step model (a factory) with PP x DP x TP:
                                train_step(tokens, targets), state_dict(); offload=, segments="auto";
                                meta-built factories (each stage allocates its part), load/save_pretrained,
                                save/load_checkpoint
    oases.pipeline.schedules    gpipe / 1f1b / aiao (FOLD3D) as per-stage action lists, with timelines
    oases.pipeline.stages       which layers a stage holds (FOLD3D's folding into segments), the stage module
    oases.pipeline.p2p          asynchronous activation / gradient transfers between stages
    oases.pipeline.dp_sync      per-segment asynchronous DP gradient sync (FOLD3D DPComm), flat buckets
    oases.pipeline.tied         tied embedding / head: copies on the first and last stage, gradients summed
    oases.pipeline.zero_sync    the same as ZeRO-1 (zero=True): reduce-scatter of rows, all-gather after the step
    oases.pipeline.comm_scheduler  one rank's comm scheduler: PP transfers preempt chunked DP sync
"""

from oases.pipeline.comm_scheduler import CommScheduler
from oases.pipeline.dp_sync import SegmentSync
from oases.pipeline.pipeline import Pipeline
from oases.pipeline.schedules import SCHEDULES, Action, actions
from oases.pipeline.stages import Stage, StageLayout
from oases.pipeline.zero_sync import ZeroSegmentSync

__all__ = [
    "Pipeline",
    "CommScheduler",
    "SegmentSync",
    "ZeroSegmentSync",
    "SCHEDULES",
    "Action",
    "actions",
    "Stage",
    "StageLayout",
]
