"""`train_step`: a step's sub-batch programs built and interleaved (oases.schedule.runtime)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch
import torch.distributed as dist

from oases.degrees import refuse_with_degrees
from oases.offload import Offloader
from oases.schedule.budget import RecomputeChoice, choose_recompute
from oases.schedule.options import StepBatch, StepOptions
from oases.schedule.placed import PlacedStep, check_placements
from oases.schedule.programs import _program
from oases.schedule.protocol import LayerPlacements, Stack, SubBatch
from oases.schedule.runtime import Communicator, interleave
from oases.schedule.sequence_parallel import (
    _program_sp,
    _program_sp_fine,
    _sum_over_group,
    sequence_parallel_parameters,
)
from oases.schedule.table import (
    FULL,
    KEEP,
    RECOMPUTE_AUTO,
    RECOMPUTE_SELECTIVE,
    SCHEDULES,
    SELECTIVE,
    LossSum,
    Recompute,
    RecomputeMemory,
    Schedule,
    _OffloadedRecomputeInputs,
    _RecomputeInputs,
    layer_modes,
    split_rows,
)

__all__ = ["train_step", "run_step", "check_placed", "stack_placements"]

logger = logging.getLogger("oases")


def train_step(
    stack: Stack,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    loss_sum: LossSum,
    normalizer: float,
    comm: Communicator,
    schedule: str = "oases",
    sub_batches: Optional[int] = None,
    sequence_parallel: bool = False,
    dropout_seed: Optional[int] = None,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    memory: Optional[RecomputeMemory] = None,
    offload: Optional[Offloader] = None,
    recompute: Recompute = True,
    memory_budget: Optional[float] = None,
    choices: Optional[dict] = None,
) -> torch.Tensor:
    """Forward and backward of sum(loss_sum(logits, labels)) / normalizer on `schedule`.

    ::

        for rows in split(batch, sub_batches):                # interleaved, see the module docstring
            loss += loss_sum(stack.head(stack_forward(input_ids[rows])), labels[rows]) / normalizer
        parameter .grad += d loss / d parameter;  return loss (a detached scalar)

    `sub_batches` None takes the schedule's own (megatron 1, the others 2); odd batches split
    unevenly (3 -> 1 + 2). `sequence_parallel`: the residual stream between sublayers is this
    rank's slice of the sequence (its length must divide by the TP size), each sublayer gathers
    its normed input and reduce-scatters its output (see above), and the gradients of the
    parameters of norm and finish are summed over the group after the step. `comm` issues and
    counts the communication on the TP group; `memory` (a RecomputeMemory) accounts the inputs
    kept for recomputation (on the device). `offload` (an oases.offload.Offloader) moves those
    inputs to host memory in batches as the forward saves them and brings them back, a batch
    ahead, in the backward's order of use (one group per sub-batch: copies per step
    = sum over sub-batches of ceil(inputs / offload.batch) each way); the same losses and
    gradients, bit for bit. With `stack.layer_placements()` (per-layer TP degrees) each layer
    communicates on its own Communicator and `comm` is not used; every sub-batch needs at least
    a row per replica of each layer (blocks differ by a row where the replicas do not divide
    its rows), and sequence_parallel and offload are refused
    (ValueError). `recompute=False` keeps each sublayer's forward graph (autograd's activations,
    as a model trained without activation checkpointing holds them) and runs the backward on it,
    with the schedule's sub-batches and overlap: the compute of one forward less per step, the
    memory of every activation more (not with sequence_parallel or offload; `memory` then counts
    nothing). `recompute="selective"` keeps those graphs saving only the outputs of the matrix
    products and attention, and recomputes the rest (norms, rotary, activations) in the backward
    (oases.schedule.selective): no GEMM twice, less memory than False, the same gradients.
    A list, one of True / False / "selective" per layer of the stack, sets each layer's mode:
    kept layers run as above, recomputed ones as the schedule recomputes (per sublayer for
    "oases", per layer for the others); the same gradients for any assignment.
    `attention_mask` and `position_ids` [b, t] reach `stack.embed` as each sub-batch's rows
    (SubBatch.attention_mask, SubBatch.position_ids).
    Checks run before any communication, so a bad argument raises on every rank alike.
    """
    options = StepOptions(schedule, sub_batches, sequence_parallel, recompute, memory_budget, offload, memory)
    checked = options.check(
        input_ids, labels, world_size=comm.world_size, attention_mask=attention_mask, position_ids=position_ids
    )
    placements = stack_placements(stack)
    check_placed(stack, checked, options, placements)
    return run_step(
        stack,
        checked,
        options,
        loss_sum=loss_sum,
        normalizer=normalizer,
        comm=comm,
        dropout_seed=dropout_seed,
        placements=placements,
        choices=choices,
    )


def stack_placements(stack: Stack) -> Optional[LayerPlacements]:
    """The stack's per-layer placements (`stack.layer_placements()`, oases.schedule.protocol; None
    without them)."""
    get_placements = getattr(stack, "layer_placements", None)
    return get_placements() if get_placements is not None else None


def check_placed(stack: Stack, batch: StepBatch, options: StepOptions, placements: Optional[LayerPlacements]) -> None:
    """The step's checks that need its per-layer placements (local, the same on every rank, before any
    communication): every sub-batch holds a row for each replica of each layer (check_placements), and
    per-layer degrees refuse offload and partial_parameters (LoRA's replicated factors)."""
    check_placements(placements, batch.input_ids.shape[0], batch.parts, sequence_parallel=options.sequence_parallel)
    if placements is None:
        return
    refuse_with_degrees("offload", options.offload, fix="pass offload=None")
    if partial_parameters(stack):
        raise ValueError(
            f"tp_degrees: {type(stack).__name__} has parameters whose gradients the schedule sums "
            "(partial_parameters: LoRA's replicated factors); not with per-layer TP degrees"
        )


def run_step(
    stack: Stack,
    batch: StepBatch,
    options: StepOptions,
    *,
    loss_sum: LossSum,
    normalizer: float,
    comm: Communicator,
    dropout_seed: Optional[int],
    placements: Optional[LayerPlacements],
    choices: Optional[dict] = None,
) -> torch.Tensor:
    """train_step on a batch its options checked (StepOptions.check) and the stack's placements
    resolved and checked by the caller (stack_placements, check_placed), before the step's seed was
    drawn: what oases.train_step, GPT.train_step and train_step above run, with no check repeated."""
    partial = partial_parameters(stack)
    sched, memory = _schedule_of(stack, batch, options, comm, dropout_seed, placements, choices)
    if placements is not None:
        return _train_step_placed(stack, placements, batch, loss_sum, normalizer, sched, comm, dropout_seed, memory)
    return _train_step_programs(stack, batch, options, loss_sum, normalizer, sched, comm, dropout_seed, memory, partial)


def _schedule_of(
    stack: Stack,
    batch: StepBatch,
    options: StepOptions,
    comm: Communicator,
    dropout_seed: Optional[int],
    placements: Optional[LayerPlacements],
    choices: Optional[dict],
) -> tuple[Schedule, RecomputeMemory]:
    """(the step's Schedule with its recomputation modes, the RecomputeMemory accounting it):
    recompute="auto" chosen here (its choice kept on the memory), a per-layer list as layers, one
    mode for every layer as the schedule's own."""
    sched, recompute = SCHEDULES[options.schedule], options.recompute
    memory = RecomputeMemory() if options.memory is None else options.memory
    if recompute == RECOMPUTE_AUTO:
        only_full = (
            "sequence parallel"
            if options.sequence_parallel
            else "offload"
            if options.offload is not None
            else "per-layer TP degrees"
            if placements is not None
            else ""
        )
        where = _sub_batch(slice(0, 1), batch, dropout_seed)
        choice = _auto(stack, batch, sched, comm, options.memory_budget, choices, only_full, where)
        recompute = choice.recompute
        if options.memory is not None:
            memory.choice = choice
    modes = layer_modes(recompute, len(list(stack.layers())))
    if modes is not None and len(set(modes)) == 1:  # one mode for every layer, given as a list
        modes, recompute = None, {FULL: True, KEEP: False, SELECTIVE: RECOMPUTE_SELECTIVE}[modes[0]]
    if modes is not None:  # per layer: kept ones from their graphs, the others as the schedule recomputes
        sched = dataclasses.replace(sched, layers=modes)
    elif recompute is not True:  # per sublayer, from the kept graphs
        sched = dataclasses.replace(
            sched, fine_grained_recompute=True, recompute=False, selective=recompute == RECOMPUTE_SELECTIVE
        )
    return sched, memory


def _train_step_programs(
    stack: Stack,
    batch: StepBatch,
    options: StepOptions,
    loss_sum: LossSum,
    normalizer: float,
    sched: Schedule,
    comm: Communicator,
    dropout_seed: Optional[int],
    memory: RecomputeMemory,
    partial: list[torch.Tensor],
) -> torch.Tensor:
    """run_step at one TP degree: the sub-batches' programs interleaved (sequence-parallel ones on
    sequence slices), the inputs kept for recomputation offloaded with `options.offload`, and the
    gradients the schedule leaves as shares (sequence-parallel, partial_parameters) summed after."""
    offload, rows = options.offload, batch.input_ids.shape[0]
    partial_before = [None if p.grad is None else p.grad.clone() for p in partial]
    program, extra = _program, ()
    if options.sequence_parallel:
        params = sequence_parallel_parameters(stack)
        before = [None if p.grad is None else p.grad.clone() for p in params]
        rank = 0 if comm.world_size == 1 else dist.get_rank(comm.group)
        threaded = sched.fine_grained_recompute and comm.has_thread
        program, extra = (_program_sp_fine if threaded else _program_sp), (rank,)
    programs = [
        program(
            stack,
            batch.input_ids[r],
            batch.labels[r],
            _sub_batch(r, batch, dropout_seed),
            loss_sum,
            normalizer,
            sched,
            comm,
            _RecomputeInputs(memory) if offload is None else _OffloadedRecomputeInputs(offload, k),
            *extra,
        )
        for k, r in enumerate(split_rows(rows, batch.parts))
    ]
    if offload is not None:
        offload.begin_step()
    loss = sum(interleave(programs, on_resume=comm.resumed)) / normalizer
    if offload is not None:
        memory.peak = max(memory.peak, offload.end_step().peak_resident_bytes)
    if options.sequence_parallel and comm.world_size > 1:
        _sum_over_group(params, before, comm)
    if partial and comm.world_size > 1:
        _sum_over_group(partial, partial_before, comm)
    return loss


def _auto(
    stack: Stack,
    batch: StepBatch,
    sched: Schedule,
    comm: Communicator,
    memory_budget: Optional[float],
    choices: Optional[dict],
    only_full: str,
    where: SubBatch,
) -> RecomputeChoice:
    """recompute="auto"'s choice for this step's shape (oases.schedule.budget): from `choices`
    (the caller's cache, by shape) or chosen now and logged once."""
    input_ids, parts = batch.input_ids, batch.parts
    key = (tuple(input_ids.shape), parts, sched.fine_grained_recompute, memory_budget, only_full)
    if choices is not None and key in choices:
        return choices[key]
    choice = choose_recompute(
        stack,
        input_ids,
        where,
        parts=parts,
        fine=sched.fine_grained_recompute,
        comm=comm,
        memory_budget=memory_budget,
        only_full=only_full,
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("%s (input %s)", choice.describe(), tuple(input_ids.shape))
    if choices is not None:
        choices[key] = choice
    return choice


def partial_parameters(stack: Stack) -> list[torch.Tensor]:
    """The stack's parameters whose gradients its cores leave as this rank's shares (stack.
    partial_parameters(), oases.schedule.protocol; none without it): train_step sums what the
    step added to them over the TP group after the backwards, in one all-reduce."""
    get = getattr(stack, "partial_parameters", None)
    return [p for p in get() if p.requires_grad] if get is not None else []


def _sub_batch(rows: slice, batch: StepBatch, seed: Optional[int]) -> SubBatch:
    """The SubBatch of `rows`: their padding mask and token positions."""
    mask, positions = batch.attention_mask, batch.position_ids
    return SubBatch(
        rows,
        batch.input_ids.shape[0],
        seed,
        None if mask is None else mask[rows],
        position_ids=None if positions is None else positions[rows],
    )


def _train_step_placed(
    stack: Stack,
    placements: LayerPlacements,
    batch: StepBatch,
    loss_sum: LossSum,
    normalizer: float,
    sched: Schedule,
    comm: Communicator,
    dropout_seed: Optional[int],
    memory: RecomputeMemory,
) -> torch.Tensor:
    """run_step with per-layer TP degrees (see oases.schedule.protocol): the same programs, each
    layer on its own communicator; the replicas' gradient sums started as layers finish."""
    placed = PlacedStep(placements, batch.parts)
    with placements.while_scheduled():
        placed.begin()
        try:
            programs = [
                _program(
                    stack,
                    batch.input_ids[r],
                    batch.labels[r],
                    _sub_batch(r, batch, dropout_seed),
                    loss_sum,
                    normalizer,
                    sched,
                    comm,
                    _RecomputeInputs(memory),
                    placed,
                )
                for r in split_rows(batch.input_ids.shape[0], batch.parts)
            ]
            loss = sum(interleave(programs)) / normalizer
            placed.finish()
        finally:
            placed.restore()
    return loss
