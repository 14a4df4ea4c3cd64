"""The schedules' table and what a step keeps for recomputation.

Training schedules for a stack of TP sublayers `x = x + finish(all_reduce(core(norm(x))))`
(the model implements oases.schedule.Stack: an embedding, layers of sublayers, a head). They
differ in how the batch is split and what is recomputed (per layer of 2 sublayers, as in a
Llama or GPT):

    schedule    sub-batches  recomputation             pass barriers   all-reduces per layer
    megatron    1            full, per layer (with AR)  -               6 (2 fwd, 2 recompute, 2 bwd)
    merak       2            full, per layer (with AR)  yes             6, each as 2 half-size
    cross_pass  2            full, per layer (with AR)  no              6, each as 2 half-size
    oases       2            per sublayer, no AR        no              4, each as 2 half-size

(`sub_batches` overrides the count: 1 to 8, each all-reduce then split that many ways.) The
programs that run them: oases.schedule.programs (and .sequence_parallel); the step that
interleaves them: oases.schedule.step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch

from oases import _checks
from oases._deprecated import renamed as _renamed
from oases._rows import split_rows
from oases.costs.recompute import FULL, KEEP, SELECTIVE  # a layer's modes: one home
from oases.costs.schedules import SCHEDULES, Schedule  # the table: one home, the planner's too
from oases.offload import OffloadStack

__all__ = [
    "SCHEDULES",
    "Schedule",
    "MAX_SUB_BATCHES",
    "Recompute",
    "LayerRecompute",
    "RecomputeMemory",
    "LossSum",
    "split_rows",
    "check_step",
]

MAX_SUB_BATCHES = 8

# train_step's recompute: True (the schedule's recomputation), False (each sublayer's graph kept) or
# "selective" (kept, saving only GEMM and attention outputs: oases.schedule.selective), for every
# layer, or one of them per layer (a list as long as the stack's layers)
RECOMPUTE_SELECTIVE = "selective"
RECOMPUTE_AUTO = "auto"  # each layer's mode chosen for a memory budget (oases.schedule.budget)
LayerRecompute = Union[bool, Literal["selective"]]
Recompute = Union[Literal["auto"], LayerRecompute, Sequence[LayerRecompute]]
_MODE_OF = {True: FULL, False: KEEP, RECOMPUTE_SELECTIVE: SELECTIVE}


def _layer_mode(value: object) -> Optional[str]:
    """FULL, KEEP or SELECTIVE for one layer's recompute value, None for anything else."""
    if isinstance(value, bool):
        return FULL if value else KEEP
    return SELECTIVE if value == RECOMPUTE_SELECTIVE else None


def layer_modes(recompute: object, layers: Optional[int] = None) -> Optional[tuple[str, ...]]:
    """train_step's `recompute` as one mode per layer (None: the same for every layer, given as
    one value, or "auto"); TypeError / ValueError naming the argument (a list's length checked
    against `layers` where given)."""
    if isinstance(recompute, (bool, str)):
        if _layer_mode(recompute) is None and recompute != RECOMPUTE_AUTO:
            raise TypeError(
                f"recompute: expected {RECOMPUTE_AUTO!r}, True, False, {RECOMPUTE_SELECTIVE!r} or a list of "
                f"them (one per layer), got {recompute!r}"
            )
        return None
    if not isinstance(recompute, (list, tuple)):
        raise TypeError(
            f"recompute: expected {RECOMPUTE_AUTO!r}, True, False, {RECOMPUTE_SELECTIVE!r} or a list of "
            f"them (one per layer), got {type(recompute).__name__}"
        )
    modes = tuple(_layer_mode(value) for value in recompute)
    if None in modes:
        bad = next(value for value, mode in zip(recompute, modes) if mode is None)
        raise TypeError(f"recompute: each layer's value must be True, False or {RECOMPUTE_SELECTIVE!r}, got {bad!r}")
    if layers is not None and len(modes) != layers:
        raise ValueError(f"recompute: {len(modes)} values for a model of {layers} layers; give one per layer")
    return modes


@dataclass
class RecomputeMemory:
    """Bytes of the sublayer (or layer) inputs a step keeps for recomputation, over every
    sub-batch: `held` now, `peak` the most at once (the activation memory a schedule controls)."""

    held: int = 0
    peak: int = 0
    choice: Any = None  # recompute="auto": the step's oases.schedule.budget.RecomputeChoice


class _RecomputeInputs:
    """A program's stack of kept inputs, accounted in a RecomputeMemory shared by the programs."""

    def __init__(self, memory: RecomputeMemory) -> None:
        self._items: list[torch.Tensor] = []
        self._memory = memory

    def push(self, t: torch.Tensor) -> None:
        self._items.append(t)
        self._memory.held += t.numel() * t.element_size()
        self._memory.peak = max(self._memory.peak, self._memory.held)

    def pop(self) -> torch.Tensor:
        t = self._items.pop()
        self._memory.held -= t.numel() * t.element_size()
        return t

    def flush(self) -> None:
        """The forward is done (nothing to do: the inputs stay on the device)."""


class _OffloadedRecomputeInputs(OffloadStack):
    """A program's kept inputs through an oases.offload.Offloader: they leave the device in
    batches as they are pushed and come back, a batch ahead, as they are popped. The offloader
    accounts the device-resident bytes (train_step copies its peak into the RecomputeMemory)."""


# loss_sum(logits [b, t, vocab], labels [b, t]) -> the sub-batch's summed loss (a scalar)
LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_step(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    schedule: str,
    sub_batches: Optional[int],
    sequence_parallel: bool,
    attention_mask: Optional[torch.Tensor],
    world_size: int,
    recompute: Recompute = True,
    offload: bool = False,
    position_ids: Optional[torch.Tensor] = None,
) -> int:
    """Raise ValueError for arguments train_step cannot run (the same on every rank, before any
    communication); return the number of sub-batches."""
    modes = layer_modes(recompute)
    kept = recompute not in (True, RECOMPUTE_AUTO) if modes is None else any(mode != FULL for mode in modes)
    if kept and sequence_parallel:
        raise ValueError(
            f"recompute={recompute!r}: not with sequence_parallel (its sublayers are recomputed "
            "from their sequence slices); pass recompute=True"
        )
    if kept and offload:
        raise ValueError(
            f"recompute={recompute!r}: not with offload (it moves the inputs kept for "
            "recomputation); pass recompute=True"
        )
    _checks.one_of("schedule", schedule, SCHEDULES)
    parts = SCHEDULES[schedule].sub_batches if sub_batches is None else sub_batches
    if not _checks.is_int(parts) or not 1 <= parts <= MAX_SUB_BATCHES:
        raise ValueError(
            f"sub_batches: expected an int in 1..{MAX_SUB_BATCHES} (or None for the schedule's "
            f"own), got {sub_batches!r}"
        )
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected [batch, seq], got shape {tuple(input_ids.shape)}")
    for name, ids in (("input_ids", input_ids), ("labels", labels)):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer tensor of token ids, got {ids.dtype} (convert with .long())")
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels: shape {tuple(labels.shape)} differs from input_ids' {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask: shape {tuple(attention_mask.shape)} differs from input_ids' {tuple(input_ids.shape)}"
        )
    if position_ids is not None:
        if position_ids.shape != input_ids.shape:
            raise ValueError(
                f"position_ids: shape {tuple(position_ids.shape)} differs from input_ids' {tuple(input_ids.shape)}"
            )
        if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
            raise TypeError(
                f"position_ids: expected an integer tensor, got {position_ids.dtype} (convert with .long())"
            )
    batch = input_ids.shape[0]
    if batch < parts:
        raise ValueError(
            f"input_ids: schedule {schedule!r} splits the batch into {parts} sub-batches; got "
            f"batch size {batch} (use at least {parts}, or fewer sub_batches)"
        )
    if sequence_parallel and input_ids.shape[1] % world_size:
        raise ValueError(
            f"input_ids: sequence_parallel splits the sequence over {world_size} ranks; got "
            f"length {input_ids.shape[1]} (pad it to a multiple of {world_size})"
        )
    return parts


__getattr__ = _renamed(
    __name__, {"CheckpointMemory": "RecomputeMemory"}, globals(), public="oases.schedule"
)  # the old names warn
