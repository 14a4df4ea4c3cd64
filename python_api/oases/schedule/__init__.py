"""Training schedules for TP transformer stacks: megatron, merak, cross_pass, oases."""
from oases.schedule.runtime import BARRIER, Communicator, interleave
from oases.schedule.stack import SCHEDULES, Schedule, train_step

__all__ = ["SCHEDULES", "Schedule", "train_step", "Communicator", "interleave", "BARRIER"]
