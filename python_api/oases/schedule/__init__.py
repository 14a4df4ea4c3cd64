"""Training schedules for TP transformer stacks: megatron, merak, cross_pass, oases.

A model reaches them by implementing `Stack` (oases.schedule.protocol); `oases.train_step` finds
or builds that for a parallelized model and calls `train_step` here.
"""
from oases.schedule.protocol import Stack, SubBatch, Sublayer
from oases.schedule.runtime import BARRIER, Communicator, interleave
from oases.schedule.stack import (MAX_SUB_BATCHES, SCHEDULES, CheckpointMemory, Schedule, check_step, split_rows,
                                  train_step)

__all__ = ["SCHEDULES", "Schedule", "MAX_SUB_BATCHES", "CheckpointMemory", "train_step", "check_step", "split_rows", "Stack", "Sublayer",
           "SubBatch", "Communicator", "interleave", "BARRIER"]
