"""Per-layer TP degrees inside a step: rows moved at layer boundaries, gradients summed over replicas.

A stack with per-layer TP degrees (`stack.layer_placements()`, see oases.schedule.protocol) runs
the same programs (oases.schedule.programs) with each layer on its own Communicator and its
replica's rows of the sub-batch (blocks of unequal size where the replicas do not divide it):
the rows move at layer boundaries (a local split going down a degree, an all-gather going up;
adjoints in backward), and each layer's parameter gradients are summed over its replicas once
the last sub-batch's backward of it ends (asynchronous, waited for at the end).

`layer_placements` makes a stack's LayerPlacements from the model's oases.degrees.LayerDegrees
(oases.models.GPT and the Hugging Face adapter both hand the schedules these):

    for layer l at degree d:  LayerPlacement(Placement at d, Communicator(tp group of d),
                                             rows_in = RowMove(d_{l-1} -> d), Communicator(replica group),
                                             layer's parameters)
    rows_out = RowMove(d_{L-1} -> p);  while_scheduled: degrees.replica_sums_suspended (the hooks stand down)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generator, Optional, Sequence

import torch
import torch.nn as nn

from oases._rows import own_part, padded, unpadded
from oases.degrees import LayerDegrees, refuse_with_degrees
from oases.schedule.protocol import LayerPlacement, LayerPlacements, RowMove, Stack, SubBatch, with_tokens
from oases.schedule.runtime import Communicator
from oases.schedule.table import split_rows

__all__ = ["PlacedStep", "check_placements", "layer_placements", "move_rows", "move_rows_adjoint"]


def layer_placements(
    degrees: LayerDegrees, layers: Sequence[nn.Module], *, comm_at_p: Optional[Communicator] = None
) -> LayerPlacements:
    """The placements of `layers` at `degrees` (one Communicator per degree, per replica group and
    per pair of neighbouring degrees, made here, once; `comm_at_p`: the one to reuse at degree p,
    e.g. the model's own). A schedule enters `while_scheduled()`: the replica-sum hooks stand down."""
    p = degrees.p
    comms = {
        d: comm_at_p if d == p and comm_at_p is not None else Communicator(at.tp_group if d > 1 else None, d)
        for d, at in degrees.placements.items()
    }
    replica_comms = {
        d: Communicator(at.replica_group, at.replicas)
        for d, at in degrees.placements.items()
        if at.replica_group is not None
    }
    ups: dict[tuple[int, int], RowMove] = {}  # one Communicator per pair of neighbouring degrees

    def move(a: int, b: int) -> Optional[RowMove]:  # rows of degree a -> those of degree b
        if a == b:
            return None
        lo, hi = min(a, b), max(a, b)
        if (lo, hi) not in ups:
            at = degrees.row_groups[lo, hi]
            ups[lo, hi] = RowMove(Communicator(at.group, at.parts), False, at)
        return dataclasses.replace(ups[lo, hi], down=b < a)

    placed, previous = [], p
    for d, layer in zip(degrees.degrees, layers):
        at = degrees.placements[d]
        placed.append(LayerPlacement(at, comms[d], move(previous, d), replica_comms.get(d), tuple(layer.parameters())))
        previous = d
    return LayerPlacements(tuple(placed), move(previous, p), degrees.replica_sums_suspended)


# ---- per-layer TP degrees: rows moved at layer boundaries, gradients summed over replicas -------------
#
#   forward, layer l at degree d_l (R_l = p / d_l replicas), sub-batch of b rows:
#     x [~b d_{l-1} / p, t, h] --RowMove--> [~b d_l / p, t, h]; layer l on comm_l (its replica's TP group)
#     (replica j's block: oases._rows.block_rows(b, R_l, j); unequal blocks are all-gathered padded)
#   backward: the RowMove's adjoint at the same boundary (all-gather <-> keep a block)
#   after the last sub-batch's backward of layer l: start the all-reduce of its parameter gradients
#   over its R_l replicas (asynchronous; waited for at the end of the step)
#     compute: | A: bwd layer 3 | B: bwd layer 3 | A: bwd layer 2 | B: bwd layer 2 | ...
#     comm   :                                   | sum layer 3 over replicas       | sum layer 2 ...


def move_rows(move: RowMove, x: torch.Tensor, batch: int, phase: str) -> Generator:
    """RowMove forward for a sub-batch of `batch` rows: keep this rank's part of the rows (down),
    or all-gather the parts (up)."""
    if move.down:
        return own_part(x, move.rows.sizes(batch), move.rows.index)
    return (yield from _gather_parts(move, x, batch, phase))


def move_rows_adjoint(move: RowMove, grad: torch.Tensor, batch: int) -> Generator:
    """RowMove backward: all-gather the parts' gradients (down), or keep this rank's part (up)."""
    if move.down:
        return (yield from _gather_parts(move, grad, batch, "backward"))
    return own_part(grad, move.rows.sizes(batch), move.rows.index)


def _gather_parts(move: RowMove, x: torch.Tensor, batch: int, phase: str) -> Generator:
    """cat(each rank's part, dim 0) over move.comm, unequal parts padded to the largest and cut after."""
    sizes = move.rows.sizes(batch)
    return unpadded((yield from move.comm.all_gather(padded(x.contiguous(), sizes), 0, phase)), sizes)


def _with_replica_rows(stack: Stack, ctx: Any, rows: slice) -> Any:
    """ctx narrowed to a replica's `rows` of the sub-batch: the stack's replica_ctx, or by default
    its SubBatch (ctx itself, or its `where`) narrowed by SubBatch.replica_rows."""
    narrow = getattr(stack, "replica_ctx", None)
    if narrow is not None:
        return narrow(ctx, rows)
    where = ctx if isinstance(ctx, SubBatch) else getattr(ctx, "where", None)
    return with_tokens(ctx, where.replica_rows(rows)) if isinstance(where, SubBatch) else ctx


class PlacedStep:
    """A step's per-layer placements, shared by its programs: each program's per-layer
    communicators, ctxs and row moves; and the sums of the layers' parameter gradients over their
    replicas, each started (asynchronously) when the last program has finished that layer's
    backward. The step's gradients are kept apart from what .grad held before (`begin`), so only
    they are summed; `finish` waits, and adds them back."""

    def __init__(self, placements: LayerPlacements, programs: int) -> None:
        self.placements, self._programs = placements, programs
        self._done = [0] * len(placements.layers)
        self._params: list[list[torch.Tensor]] = []
        for at in placements.layers:
            seen: dict[int, torch.Tensor] = {}
            if at.replica_comm is not None and at.replica_comm.world_size > 1:
                seen = {id(p): p for p in at.parameters if p.requires_grad}
            self._params.append(list(seen.values()))
        self._before: dict[int, Optional[torch.Tensor]] = {}
        self._pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []

    def per_layer(self, stack: Stack, ctx: Any, batch: int):
        """(communicators, ctxs, row moves into each layer, row move out) for a sub-batch of `batch` rows."""
        layers = self.placements.layers
        narrowed: dict[tuple[int, int], Any] = {}  # one narrowed ctx per distinct (replica, replicas)
        ctxs = []
        for at in layers:
            key = (at.place.replica, at.place.replicas)
            if key not in narrowed:
                narrowed[key] = ctx if at.place.replicas == 1 else _with_replica_rows(stack, ctx, at.place.rows(batch))
            ctxs.append(narrowed[key])
        return [at.comm for at in layers], ctxs, [at.rows_in for at in layers], self.placements.rows_out

    def begin(self) -> None:
        """Set aside the gradients the summed parameters hold before the step."""
        for params in self._params:
            for p in params:
                if id(p) not in self._before:
                    self._before[id(p)] = p.grad
                    p.grad = None

    def layer_done(self, index: int) -> None:
        """A program finished layer `index`'s backward; after the last program, start the sum of the
        layer's parameter gradients (and a has-gradient flag each) over its replicas."""
        self._done[index] += 1
        params = self._params[index]
        if self._done[index] < self._programs or not params:
            return
        # Every replica sends every parameter (zeros where it has no gradient) and one flag per
        # parameter, so the sums line up whichever replicas' rows reached a parameter.
        parts = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params]
        flags = torch.tensor([float(p.grad is not None) for p in params], dtype=parts[0].dtype, device=parts[0].device)
        flat = torch.cat([*parts, flags])  # [sum of numels + len(params)]
        work = self.placements.layers[index].replica_comm.all_reduce(flat, "backward")
        self._pending.append((work, flat, params))

    def finish(self) -> None:
        """Wait for the sums, write them to .grad and add back what .grad held before the step."""
        for work, flat, params in self._pending:
            work.wait()
            offset = 0
            for p, has in zip(params, flat[-len(params) :].tolist()):
                if has:  # some replica had a gradient: the sum, as one process would have it
                    p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype, copy=True)
                offset += p.numel()
        self._pending.clear()
        self.restore()

    def restore(self) -> None:
        """Add back what .grad held before the step (also after a failure: nothing is lost)."""
        for params in self._params:
            for p in params:
                if id(p) not in self._before:
                    continue
                before = self._before.pop(id(p))
                if before is not None:
                    p.grad = before if p.grad is None else before.add_(p.grad)


def check_placements(placements: Optional[LayerPlacements], batch: int, parts: int, *, sequence_parallel: bool) -> None:
    """ValueError unless every sub-batch has a row for each replica of every layer (before any
    communication, the same on every rank); the rows need not divide evenly."""
    if placements is None:
        return
    refuse_with_degrees("sequence_parallel", sequence_parallel)
    most = placements.most_replicas
    sizes = [r.stop - r.start for r in split_rows(batch, parts)]
    if min(sizes) < most:
        raise ValueError(
            f"input_ids: per-layer tp_degrees run up to {most} replicas, each on its own block of "
            f"every sub-batch's rows; batch size {batch} in {parts} sub-batches gives {sizes} rows "
            f"(use a batch of at least {most * parts} rows, or fewer sub_batches)"
        )
