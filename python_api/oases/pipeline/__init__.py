"""Pipeline parallelism for the GPT: stages, segments, schedules, on a (dp, pp, tp) device mesh.

    oases.pipeline.Pipeline     train a GPT with PP x DP x TP: train_step(tokens, targets), state_dict()
    oases.pipeline.schedules    gpipe / 1f1b / aiao (FOLD3D) as per-stage action lists, with timelines
    oases.pipeline.stages       which layers a stage holds (FOLD3D's folding into segments), the stage module
    oases.pipeline.p2p          asynchronous activation / gradient transfers between stages
"""
from oases.pipeline.pipeline import Pipeline
from oases.pipeline.schedules import SCHEDULES, Action, actions
from oases.pipeline.stages import Stage, StageLayout

__all__ = ["Pipeline", "SCHEDULES", "Action", "actions", "Stage", "StageLayout"]
