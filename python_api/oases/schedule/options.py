"""`StepOptions`: how one training step runs, the one record the step functions share.

::

    options = StepOptions(schedule="oases", sub_batches=None, sequence_parallel=False,
                          recompute=True, memory_budget=None, offload=None, memory=None)
    batch = options.check(input_ids, labels, world_size=p, attention_mask=..., position_ids=...)
    #       every argument check (oases.schedule.table.check_step), once, before any communication
    placements = stack_placements(stack); check_placed(stack, batch, options, placements)
    seed = <the step's dropout seed>                     # drawn (a broadcast) after every check
    loss = run_step(stack, batch, options, placements=placements, dropout_seed=seed, loss_sum=..., ...)

oases.train_step, oases.models.GPT.train_step and oases.schedule.train_step each turn their keyword
arguments into one StepOptions, check the batch once with it and hand both to the same runner
(`oases.schedule.step.run_step`); nothing is passed along by hand below them. The Pipeline takes its
options at construction (oases.pipeline._config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from oases.offload import Offloader
from oases.schedule.table import Recompute, RecomputeMemory, check_step

__all__ = ["StepOptions", "StepBatch"]


@dataclass(frozen=True)
class StepOptions:
    """A step's options (see oases.train_step for each one's meaning).

    schedule: a name in oases.schedule.SCHEDULES; sub_batches: None for the schedule's own;
    recompute: True, False, "selective", "auto" or one of those per layer; memory_budget: bytes for
    "auto" (None: the device's rule); offload: the Offloader moving the inputs kept for
    recomputation (None: they stay); memory: the RecomputeMemory that accounts them (None: not
    accounted). Frozen: a step never changes its options."""

    schedule: str = "oases"
    sub_batches: Optional[int] = None
    sequence_parallel: bool = False
    recompute: Recompute = True
    memory_budget: Optional[float] = None
    offload: Optional[Offloader] = None
    memory: Optional[RecomputeMemory] = field(default=None, compare=False)

    def check(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        world_size: int,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> "StepBatch":
        """The batch checked against these options (ValueError / TypeError naming the argument, the
        same on every rank, before any communication; oases.schedule.table.check_step)."""
        if self.offload is not None and not isinstance(self.offload, Offloader):
            raise TypeError(f"offload: expected an oases.offload.Offloader or None, got {type(self.offload).__name__}")
        parts = check_step(
            input_ids,
            labels,
            schedule=self.schedule,
            sub_batches=self.sub_batches,
            sequence_parallel=self.sequence_parallel,
            attention_mask=attention_mask,
            position_ids=position_ids,
            world_size=world_size,
            recompute=self.recompute,
            offload=self.offload is not None,
        )
        return StepBatch(input_ids, labels, parts, attention_mask, position_ids)


@dataclass(frozen=True)
class StepBatch:
    """A step's batch as StepOptions.check passed it: the token ids and labels [b, t], how many
    sub-batches it is split into, and its padding mask and token positions (None: none)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    parts: int
    attention_mask: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
