"""Training schedules for a stack of TP sublayers `x = x + finish(all_reduce(core(norm(x))))`.

The model is anything implementing `oases.schedule.Stack` (see oases.schedule.protocol): an
embedding, layers of sublayers, a head. The schedules differ in how the batch is split and what
is recomputed (per layer of 2 sublayers, as in a Llama or GPT):

    schedule    sub-batches  recomputation             pass barriers   all-reduces per layer
    megatron    1            full, per layer (with AR)  -               6 (2 fwd, 2 recompute, 2 bwd)
    merak       2            full, per layer (with AR)  yes             6, each as 2 half-size
    cross_pass  2            full, per layer (with AR)  no              6, each as 2 half-size
    oases       2            per sublayer, no AR        no              4, each as 2 half-size

(`sub_batches` overrides the count: 1 to 8, each all-reduce then split that many ways.)
Fine-grained recomputation ("oases") keeps each sublayer's input, so recomputing starts after an
all-reduce and never repeats one: the gradient of an all-reduce's input is its output's gradient.
The column-parallel input's gradient (the "copy" dual) is the all-reduce of the backward pass.

    cross_pass / oases, backward of one layer (A, B: sub-batches):
      compute: | A: recompute+bwd mlp | B: recompute+bwd mlp | A: attn | B: attn | A: next layer ...
      comm   :                        | A: AR grad           | B: AR   | A: AR   | B: AR ...
    merak holds A at the end of each pass until B gets there (B's last all-reduce is exposed).

A stack with per-layer TP degrees (`stack.layer_placements()`, see oases.schedule.protocol) runs
the same programs with each layer on its own Communicator and its replica's rows of the
sub-batch (blocks of unequal size where the replicas do not divide it): the rows move at layer
boundaries (a local split going down a degree, an all-gather going up; adjoints in backward), and
each layer's parameter gradients are summed over its replicas once the last sub-batch's backward
of it ends (asynchronous, waited for at the end).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Generator, Mapping, Optional

import torch
import torch.distributed as dist

from oases._leaves import grad_leaf
from oases._rows import block_rows, padded, unpadded
from oases.offload import CheckpointStack, Offloader
from oases.schedule.protocol import LayerPlacements, RowMove, Stack, SubBatch
from oases.schedule.runtime import BARRIER, Communicator, interleave

__all__ = ["SCHEDULES", "Schedule", "MAX_SUB_BATCHES", "CheckpointMemory", "train_step", "check_step"]

MAX_SUB_BATCHES = 8


@dataclass(frozen=True)
class Schedule:
    """How a training step runs: the batch split along dim 0 into `sub_batches` interleaved
    programs (the default; train_step may override it); recomputation per sublayer from its
    input (no all-reduce) or per layer (all of it); programs held at each pass boundary or not."""

    sub_batches: int
    fine_grained_recompute: bool
    pass_barriers: bool
    recompute: bool = True  # False: each sublayer's graph kept from the forward (train_step(recompute=False))


SCHEDULES: Mapping[str, Schedule] = MappingProxyType({
    "megatron": Schedule(sub_batches=1, fine_grained_recompute=False, pass_barriers=False),
    "merak": Schedule(sub_batches=2, fine_grained_recompute=False, pass_barriers=True),
    "cross_pass": Schedule(sub_batches=2, fine_grained_recompute=False, pass_barriers=False),
    "oases": Schedule(sub_batches=2, fine_grained_recompute=True, pass_barriers=False),
})

@dataclass
class CheckpointMemory:
    """Bytes of the sublayer (or layer) inputs a step keeps for recomputation, over every
    sub-batch: `held` now, `peak` the most at once (the activation memory a schedule controls)."""

    held: int = 0
    peak: int = 0


class _Checkpoints:
    """A program's stack of kept inputs, accounted in a CheckpointMemory shared by the programs."""

    def __init__(self, memory: CheckpointMemory) -> None:
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


class _OffloadedCheckpoints(CheckpointStack):
    """A program's kept inputs through an oases.offload.Offloader: they leave the device in
    batches as they are pushed and come back, a batch ahead, as they are popped. The offloader
    accounts the device-resident bytes (train_step copies its peak into the CheckpointMemory)."""


# loss_sum(logits [b, t, vocab], labels [b, t]) -> the sub-batch's summed loss (a scalar)
LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Recorded:
    """One sublayer's recomputed graph: x -> h = norm(x) | h' (leaf) -> part = core(h')."""

    x: torch.Tensor
    h: torch.Tensor
    h_leaf: torch.Tensor
    part: torch.Tensor


def _record(sub, x: torch.Tensor, ctx: Any) -> _Recorded:
    x = grad_leaf(x)  # (not cached by autocast: see oases._leaves)
    with torch.enable_grad():
        h = sub.norm(x)
        h_leaf = grad_leaf(h)
        part = sub.core(h_leaf, ctx)
    return _Recorded(x, h, h_leaf, part)


def _backward(sub, rec: _Recorded, grad_out: torch.Tensor, ctx: Any, comm: Communicator) -> Generator:
    """Gradient of x for x_out = x + finish(AR(part)) given grad_out; accumulates parameter grads."""
    z = grad_leaf(torch.zeros_like(rec.part))  # stands for AR(part): finish is affine in it
    with torch.enable_grad():
        sub.finish(z, ctx).backward(grad_out)
    rec.part.backward(z.grad)  # AR's adjoint is the identity: grad(part) = grad(AR(part))
    grad_h = rec.h_leaf.grad  # this rank's heads / features only: sum over ranks
    if grad_h is None:  # core ignores its input (no column-parallel path): nothing to reduce
        grad_h = torch.zeros_like(rec.h_leaf)
    work = comm.all_reduce(grad_h, "backward")
    yield
    work.wait()
    rec.h.backward(grad_h)
    return grad_out + rec.x.grad


def _finish_reduced(sub, x: torch.Tensor, part: torch.Tensor, ctx: Any, comm: Communicator, phase: str) -> Generator:
    """x + finish(all_reduce(part)); all-reduces `part` in place (not a tensor autograd saved)."""
    work = comm.all_reduce(part, phase)
    yield
    work.wait()
    with torch.no_grad():
        return x + sub.finish(part, ctx)


def _program(stack: Stack, input_ids, labels, where: SubBatch, loss_sum: LossSum, normalizer: float,
             plan: Schedule, comm: Communicator, saved: _Checkpoints,
             placed: Optional["_PlacedStep"] = None) -> Generator:
    """One sub-batch's forward, loss and backward, yielding at each communication. `placed`:
    per-layer TP degrees (each layer on its own communicator and its replica's rows, the rows
    moved at the layer boundaries; see oases.schedule.protocol)."""
    layers = [tuple(layer) for layer in stack.layers()]
    with torch.enable_grad():
        embedded, ctx = stack.embed(input_ids, where)
    x, rows = embedded.detach(), embedded.shape[0]  # x [rows, t, h]
    if placed is None:
        comms, ctxs, moves, move_out = [comm] * len(layers), [ctx] * len(layers), [None] * len(layers), None
    else:
        comms, ctxs, moves, move_out = placed.per_layer(stack, ctx, rows)
    # saved: inputs of each recomputation sequence, per sublayer (oases) or per layer; kept: each
    # sublayer's forward graph instead, without recomputation
    kept: list[_Recorded] = []
    for layer, c, lctx, move in zip(layers, comms, ctxs, moves):
        if move is not None:  # the boundary between layers of different degrees: this replica's rows
            x = yield from _move_rows(move, x, rows, "forward")
        for i, sub in enumerate(layer):
            if not plan.recompute:  # the graph kept for the backward (autograd's activations held)
                rec = _record(sub, x, lctx)
                kept.append(rec)
                part = rec.part.detach().clone()  # reduced in place: not a tensor the graph holds
            else:
                if plan.fine_grained_recompute or i == 0:
                    saved.push(x)
                with torch.no_grad():
                    part = sub.core(sub.norm(x), lctx)
            x = yield from _finish_reduced(sub, x, part, lctx, c, "forward")
    if move_out is not None:  # the head runs on every row of the sub-batch
        x = yield from _move_rows(move_out, x, rows, "forward")
    saved.flush()  # offloading: the last inputs leave too, the first needed start coming back
    x = grad_leaf(x)
    with torch.enable_grad():
        loss = loss_sum(stack.head(x, ctx), labels)
        (loss / normalizer).backward()
    grad = x.grad
    if move_out is not None:
        grad = yield from _move_rows_adjoint(move_out, grad, rows)
    if plan.pass_barriers:
        yield BARRIER
    for index in reversed(range(len(layers))):
        layer, c, lctx = layers[index], comms[index], ctxs[index]
        if plan.fine_grained_recompute:
            for sub in reversed(layer):
                rec = kept.pop() if not plan.recompute else _record(sub, saved.pop(), lctx)
                grad = yield from _backward(sub, rec, grad, lctx, c)
        else:
            x_in, records = saved.pop(), []
            for sub in layer:  # activation checkpointing reruns the whole layer, its all-reduces included
                rec = _record(sub, x_in, lctx)
                records.append(rec)
                x_in = yield from _finish_reduced(sub, x_in, rec.part.detach().clone(), lctx, c, "recompute")
            if plan.pass_barriers:
                yield BARRIER
            for sub, rec in zip(reversed(layer), reversed(records)):
                grad = yield from _backward(sub, rec, grad, lctx, c)
            if plan.pass_barriers:
                yield BARRIER
        if placed is not None:
            placed.layer_done(index)  # the last sub-batch through it starts the replicas' gradient sum
            if moves[index] is not None:
                grad = yield from _move_rows_adjoint(moves[index], grad, rows)
    if embedded.requires_grad:  # a frozen embedding has nothing to learn
        embedded.backward(grad)
    return loss.detach()


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


def _move_rows(move: RowMove, x: torch.Tensor, batch: int, phase: str) -> Generator:
    """RowMove forward for a sub-batch of `batch` rows: keep this rank's part of the rows (down),
    or all-gather the parts (up)."""
    if move.down:
        return _own_part(move, x, batch)
    return (yield from _gather_parts(move, x, batch, phase))


def _move_rows_adjoint(move: RowMove, grad: torch.Tensor, batch: int) -> Generator:
    """RowMove backward: all-gather the parts' gradients (down), or keep this rank's part (up)."""
    if move.down:
        return (yield from _gather_parts(move, grad, batch, "backward"))
    return _own_part(move, grad, batch)


def _own_part(move: RowMove, x: torch.Tensor, batch: int) -> torch.Tensor:
    """This rank's part of x [sum of the parts' rows, ...]; not a view (x itself may go)."""
    sizes = move.sizes(batch)
    start = sum(sizes[:move.index])
    return x[start:start + sizes[move.index]].clone()


def _gather_parts(move: RowMove, x: torch.Tensor, batch: int, phase: str) -> Generator:
    """cat(each rank's part, dim 0) over move.comm, unequal parts padded to the largest and cut after."""
    sizes = move.sizes(batch)
    return unpadded((yield from move.comm.all_gather(padded(x.contiguous(), sizes), 0, phase)), sizes)


def _with_replica_rows(stack: Stack, ctx: Any, rows: slice) -> Any:
    """ctx narrowed to a replica's `rows` of the sub-batch: the stack's replica_ctx, or by default
    its SubBatch (ctx itself, or its `where`) narrowed by SubBatch.replica_rows."""
    narrow = getattr(stack, "replica_ctx", None)
    if narrow is not None:
        return narrow(ctx, rows)
    where = ctx if isinstance(ctx, SubBatch) else getattr(ctx, "where", None)
    return _with_tokens(ctx, where.replica_rows(rows)) if isinstance(where, SubBatch) else ctx


class _PlacedStep:
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
            key = (at.replica, at.replicas)
            if key not in narrowed:
                narrowed[key] = ctx if at.replicas == 1 else _with_replica_rows(stack, ctx, at.rows(batch))
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
        self._done[index] += 1
        params = self._params[index]
        if self._done[index] < self._programs or not params:
            return
        # Every replica sends every parameter (zeros where it has no gradient) and one flag per
        # parameter, so the sums line up whichever replicas' rows reached a parameter.
        parts = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params]
        flags = torch.tensor([float(p.grad is not None) for p in params], dtype=parts[0].dtype,
                             device=parts[0].device)
        flat = torch.cat([*parts, flags])  # [sum of numels + len(params)]
        work = self.placements.layers[index].replica_comm.all_reduce(flat, "backward")
        self._pending.append((work, flat, params))

    def finish(self) -> None:
        """Wait for the sums, write them to .grad and add back what .grad held before the step."""
        for work, flat, params in self._pending:
            work.wait()
            offset = 0
            for p, has in zip(params, flat[-len(params):].tolist()):
                if has:  # some replica had a gradient: the sum, as one process would have it
                    p.grad = flat[offset:offset + p.numel()].view_as(p).to(p.dtype, copy=True)
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


def check_placements(placements: Optional[LayerPlacements], batch: int, parts: int, *,
                     sequence_parallel: bool) -> None:
    """ValueError unless every sub-batch has a row for each replica of every layer (before any
    communication, the same on every rank); the rows need not divide evenly."""
    if placements is None:
        return
    if sequence_parallel:
        raise ValueError("sequence_parallel=True: not supported with per-layer tp_degrees (layers of different "
                         "degrees would split the sequence differently); pass sequence_parallel=False")
    most = placements.most_replicas
    sizes = [r.stop - r.start for r in split_rows(batch, parts)]
    if min(sizes) < most:
        raise ValueError(f"input_ids: per-layer tp_degrees run up to {most} replicas, each on its own block of "
                         f"every sub-batch's rows; batch size {batch} in {parts} sub-batches gives {sizes} rows "
                         f"(use a batch of at least {most * parts} rows, or fewer sub_batches)")


# ---- sequence parallelism: x is this rank's [b, t/p, h] slice of the sequence (dim 1) ----------------
#
#   forward of a sublayer:  h_r = norm(x_r); h = all_gather(h_r); z_r = reduce_scatter(core(h))
#                           x_r = x_r + finish(z_r)
#   backward (adjoints):    g_z = all_gather(grad finish); core backward -> g_h
#                           g_h_r = reduce_scatter(g_h); norm backward -> grad x_r
#   fine-grained recomputation keeps x_r (1/p of the sublayer input) and re-gathers h_r.

_SEQ = -2  # the sequence dimension: x [b, t, h] (and a stacked norm output [k, b, t, h])


def _record_sp(sub, x_r: torch.Tensor, ctx: Any, comm: Communicator, phase: str) -> Generator:
    """Rerun norm, the gather and core with autograd: the graph of one sublayer (sequence parallel)."""
    x_r = grad_leaf(x_r)
    with torch.enable_grad():
        h_r = sub.norm(x_r)
    h = yield from comm.all_gather(h_r.detach(), _SEQ, phase)
    h_leaf = grad_leaf(h)
    with torch.enable_grad():
        part = sub.core(h_leaf, ctx)
    return _Recorded(x_r, h_r, h_leaf, part)


def _forward_sp(sub, x_r: torch.Tensor, ctx: Any, comm: Communicator, phase: str,
                part: Optional[torch.Tensor] = None) -> Generator:
    """x_r + finish(reduce_scatter(core(all_gather(norm(x_r))))); `part` given: core's output already."""
    if part is None:
        with torch.no_grad():
            h_r = sub.norm(x_r)
        h = yield from comm.all_gather(h_r, _SEQ, phase)
        with torch.no_grad():
            part = sub.core(h, ctx)
    z_r = yield from comm.reduce_scatter(part, _SEQ, phase)
    with torch.no_grad():
        return x_r + sub.finish(z_r, ctx)


def _backward_sp(sub, rec: _Recorded, grad_out: torch.Tensor, ctx: Any, comm: Communicator) -> Generator:
    """Gradient of x_r for x_r + finish(RS(part)) given grad_out [b, t/p, h]; accumulates parameter grads."""
    z = grad_leaf(torch.zeros_like(grad_out))  # stands for RS(part): finish is affine in it
    with torch.enable_grad():
        sub.finish(z, ctx).backward(grad_out)
    grad_part = yield from comm.all_gather(z.grad, _SEQ, "backward")  # reduce-scatter's adjoint
    rec.part.backward(grad_part)
    grad_h = rec.h_leaf.grad if rec.h_leaf.grad is not None else torch.zeros_like(rec.h_leaf)
    grad_h_r = yield from comm.reduce_scatter(grad_h, _SEQ, "backward")  # all-gather's adjoint
    rec.h.backward(grad_h_r)
    return grad_out + rec.x.grad


def _program_sp(stack: Stack, input_ids, labels, where: SubBatch, loss_sum: LossSum, normalizer: float,
                plan: Schedule, comm: Communicator, saved: _Checkpoints, rank: int) -> Generator:
    """`_program` with the residual stream split along the sequence over the TP ranks."""
    layers = [tuple(layer) for layer in stack.layers()]
    embedded, ctx, tokens, mine = _embed_sharded(stack, input_ids, where, comm, rank)
    x = embedded.detach()[:, mine].contiguous()  # [b, t/p, h]
    for layer in layers:
        for i, sub in enumerate(layer):
            if plan.fine_grained_recompute or i == 0:
                saved.push(x)
            x = yield from _forward_sp(sub, x, tokens, comm, "forward")
    saved.flush()
    x_full = yield from comm.all_gather(x, _SEQ, "forward")  # the head sees every token, as without SP
    x_full = grad_leaf(x_full)
    with torch.enable_grad():
        loss = loss_sum(stack.head(x_full, ctx), labels)
        (loss / normalizer).backward()
    grad = x_full.grad[:, mine]  # the head ran alike on every rank: this rank's tokens' gradient
    if plan.pass_barriers:
        yield BARRIER
    for layer in reversed(layers):
        if plan.fine_grained_recompute:
            for sub in reversed(layer):
                rec = yield from _record_sp(sub, saved.pop(), tokens, comm, "recompute")
                grad = yield from _backward_sp(sub, rec, grad, tokens, comm)
            continue
        x_in, records = saved.pop(), []
        for sub in layer:
            rec = yield from _record_sp(sub, x_in, tokens, comm, "recompute")
            records.append(rec)
            x_in = yield from _forward_sp(sub, x_in, tokens, comm, "recompute", rec.part.detach())
        if plan.pass_barriers:
            yield BARRIER
        for sub, rec in zip(reversed(layer), reversed(records)):
            grad = yield from _backward_sp(sub, rec, grad, tokens, comm)
        if plan.pass_barriers:
            yield BARRIER
    grad_full = yield from comm.all_gather(grad.contiguous(), _SEQ, "backward")  # the split's adjoint
    if embedded.requires_grad:
        embedded.backward(grad_full)
    return loss.detach()


def _program_sp_fine(stack: Stack, input_ids, labels, where: SubBatch, loss_sum: LossSum, normalizer: float,
                     plan: Schedule, comm: Communicator, saved: _Checkpoints, rank: int) -> Generator:
    """Sequence parallel with fine-grained recomputation ("oases"): the program's thread runs the
    cores; everything between two cores -- scatter, finish, norm, gather, and in backward their
    adjoints -- is one task on the communicator's thread, so it overlaps the other sub-batch's core.

        forward (A, B: sub-batches)
          program thread:      | core A1 | core B1 | core A2 | core B2 | ...
          communicator thread:           | RS A1, finish, norm, AG A2 | RS B1, ... AG B2 |
        backward of sublayer l (the thread's task for l-1 waits only on l's core backward)
          program thread:      | recompute core l + backward A | ... B |
          communicator thread: | RS grad h, norm bwd; finish bwd l-1, AG grad, AG norm(x_{l-1}) |
    """
    subs = [sub for layer in stack.layers() for sub in layer]
    embedded, ctx, tokens, mine = _embed_sharded(stack, input_ids, where, comm, rank)
    x = embedded.detach()[:, mine].contiguous()  # [b, t/p, h]
    task = comm.submit(functools.partial(_between_forward, None, subs[0], x, None, tokens, comm))
    yield
    for i, sub in enumerate(subs):
        x, h = task.wait()
        saved.push(x)
        with torch.no_grad():
            part = sub.core(h, tokens)
        following = subs[i + 1] if i + 1 < len(subs) else None
        task = comm.submit(functools.partial(_between_forward, sub, following, x, part, tokens, comm))
        yield
    _, x_full = task.wait()  # the head sees every token, as without SP
    saved.flush()
    x_full = grad_leaf(x_full)
    with torch.enable_grad():
        loss = loss_sum(stack.head(x_full, ctx), labels)
        (loss / normalizer).backward()
    grad = x_full.grad[:, mine]  # the head ran alike on every rank: this rank's tokens' gradient
    task = comm.submit(functools.partial(_between_backward, None, subs[-1], grad, saved.pop(), tokens, comm))
    yield
    for i in reversed(range(len(subs))):
        grad_part, h, x_leaf, h_r, grad = task.wait()
        h_leaf = grad_leaf(h)
        with torch.enable_grad():
            part = subs[i].core(h_leaf, tokens)
        part.backward(grad_part)
        grad_h = h_leaf.grad if h_leaf.grad is not None else torch.zeros_like(h_leaf)
        earlier = subs[i - 1] if i > 0 else None
        task = comm.submit(functools.partial(_between_backward, (grad_h, x_leaf, h_r), earlier, grad,
                                             saved.pop() if i > 0 else None, tokens, comm))
        yield
    grad_full = task.wait()
    if embedded.requires_grad:
        embedded.backward(grad_full)
    return loss.detach()


def _between_forward(done, following, x_r, part, tokens, comm: Communicator):
    """On the communicator's thread: finish sublayer `done` (scatter its core's output), then
    gather the normed input of `following` (or the whole x for the head). -> (x_r, gathered)."""
    with torch.no_grad():
        if done is not None:
            x_r = x_r + done.finish(comm.reduce_scatter_sync(part, _SEQ, "forward"), tokens)
        h_r = following.norm(x_r) if following is not None else x_r
        return x_r, comm.all_gather_sync(h_r, _SEQ, "forward")


def _between_backward(done, following, grad_r, x_saved, tokens, comm: Communicator):
    """On the communicator's thread: the adjoints between two cores. `done` = (grad of the
    gathered h, x leaf, normed slice) of the sublayer whose core backward just ran: scatter the
    gradient and run its norm backward; then for the sublayer below (`following`): its finish
    backward, the gather of its core's output gradient, and the re-gather of its normed input.
    With nothing below, gather the gradient for the embedding instead."""
    with torch.enable_grad():
        if done is not None:
            grad_h, x_leaf, h_r = done
            h_r.backward(comm.reduce_scatter_sync(grad_h, _SEQ, "backward"))
            grad_r = grad_r + x_leaf.grad
        if following is None:
            return comm.all_gather_sync(grad_r.contiguous(), _SEQ, "backward")  # the split's adjoint
        z = grad_leaf(torch.zeros_like(grad_r))  # stands for RS(part): finish is affine in it
        following.finish(z, tokens).backward(grad_r)
        grad_part = comm.all_gather_sync(z.grad, _SEQ, "backward")  # reduce-scatter's adjoint
        x_leaf = grad_leaf(x_saved)
        h_r = following.norm(x_leaf)
    h = comm.all_gather_sync(h_r.detach(), _SEQ, "recompute")
    return grad_part, h, x_leaf, h_r, grad_r


def _embed_sharded(stack: Stack, input_ids, where: SubBatch, comm: Communicator, rank: int):
    """(embedded [b, t, h] with its graph, ctx, ctx for this rank's tokens, their slice of t)."""
    with torch.enable_grad():
        embedded, ctx = stack.embed(input_ids, where)  # every rank alike
    t = embedded.shape[_SEQ]
    n = t // comm.world_size
    mine = slice(rank * n, (rank + 1) * n)
    return embedded, ctx, _with_tokens(ctx, where.tokens(mine, t)), mine


def _with_tokens(ctx: Any, tokens: SubBatch) -> Any:
    """The stack's context with its SubBatch (where `finish` reads positions) narrowed to `tokens`:
    ctx itself if it is a SubBatch, else a shallow copy whose `where` attribute is replaced."""
    if isinstance(ctx, SubBatch):
        return tokens
    if isinstance(getattr(ctx, "where", None), SubBatch):
        narrowed = copy.copy(ctx)
        object.__setattr__(narrowed, "where", tokens)  # frozen dataclasses too
        return narrowed
    return ctx


def _sequence_parallel_parameters(stack: Stack) -> list[torch.Tensor]:
    found: dict[int, torch.Tensor] = {}
    for layer in stack.layers():
        for sub in layer:
            get = getattr(sub, "sequence_parallel_parameters", None)
            if get is None:
                raise ValueError(f"sequence_parallel: {type(sub).__name__} has no sequence_parallel_parameters() "
                                 "(the parameters its norm and finish use; see oases.schedule.protocol)")
            for p in get():
                if p.requires_grad:
                    found[id(p)] = p
    return list(found.values())


def _sum_over_group(params: list[torch.Tensor], before: list[Optional[torch.Tensor]], comm: Communicator) -> None:
    """Sum what this step added to each parameter's .grad over the TP group (one all-reduce)."""
    added = [p.grad - b if b is not None else p.grad for p, b in zip(params, before) if p.grad is not None]
    if not added:
        return
    flat = torch.cat([a.reshape(-1) for a in added])
    comm.all_reduce(flat, "backward").wait()
    offset = 0
    for p, b in zip(params, before):
        if p.grad is None:
            continue
        count = p.grad.numel()
        summed = flat[offset: offset + count].view_as(p.grad)
        p.grad.copy_(summed if b is None else b + summed)
        offset += count


def split_rows(batch: int, parts: int) -> list[slice]:
    """`parts` contiguous row ranges covering `batch` rows, sizes differing by at most one (3 -> 1 + 2;
    oases._rows.block_rows)."""
    return [block_rows(batch, parts, i) for i in range(parts)]


def check_step(input_ids: torch.Tensor, labels: torch.Tensor, *, schedule: str, sub_batches: Optional[int],
               sequence_parallel: bool, attention_mask: Optional[torch.Tensor], world_size: int,
               recompute: bool = True, offload: bool = False) -> int:
    """Raise ValueError for arguments train_step cannot run (the same on every rank, before any
    communication); return the number of sub-batches."""
    if not isinstance(recompute, bool):
        raise TypeError(f"recompute: expected a bool, got {recompute!r}")
    if not recompute and sequence_parallel:
        raise ValueError("recompute=False: not with sequence_parallel (its sublayers are recomputed from "
                         "their sequence slices); pass recompute=True")
    if not recompute and offload:
        raise ValueError("recompute=False: not with offload (it moves the inputs kept for recomputation); "
                         "pass recompute=True")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: {schedule!r} is not one of {sorted(SCHEDULES)}")
    parts = SCHEDULES[schedule].sub_batches if sub_batches is None else sub_batches
    if isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= MAX_SUB_BATCHES:
        raise ValueError(f"sub_batches: expected an int in 1..{MAX_SUB_BATCHES} (or None for the schedule's "
                         f"own), got {sub_batches!r}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected [batch, seq], got shape {tuple(input_ids.shape)}")
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels: shape {tuple(labels.shape)} differs from input_ids' {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask: shape {tuple(attention_mask.shape)} differs from input_ids' "
                         f"{tuple(input_ids.shape)}")
    batch = input_ids.shape[0]
    if batch < parts:
        raise ValueError(f"input_ids: schedule {schedule!r} splits the batch into {parts} sub-batches; got "
                         f"batch size {batch} (use at least {parts}, or fewer sub_batches)")
    if sequence_parallel and input_ids.shape[1] % world_size:
        raise ValueError(f"input_ids: sequence_parallel splits the sequence over {world_size} ranks; got "
                         f"length {input_ids.shape[1]} (pad it to a multiple of {world_size})")
    return parts


def train_step(stack: Stack, input_ids: torch.Tensor, labels: torch.Tensor, *, loss_sum: LossSum,
               normalizer: float, comm: Communicator, schedule: str = "oases",
               sub_batches: Optional[int] = None, sequence_parallel: bool = False,
               dropout_seed: Optional[int] = None, attention_mask: Optional[torch.Tensor] = None,
               memory: Optional[CheckpointMemory] = None, offload: Optional[Offloader] = None,
               recompute: bool = True) -> torch.Tensor:
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
    counts the communication on the TP group; `memory` (a CheckpointMemory) accounts the inputs
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
    nothing). Checks run before any communication, so a bad argument raises on every rank alike.
    """
    parts = check_step(input_ids, labels, schedule=schedule, sub_batches=sub_batches,
                       sequence_parallel=sequence_parallel, attention_mask=attention_mask,
                       world_size=comm.world_size, recompute=recompute, offload=offload is not None)
    plan, batch = SCHEDULES[schedule], input_ids.shape[0]
    if not recompute:  # per sublayer, from the kept graphs
        plan = dataclasses.replace(plan, fine_grained_recompute=True, recompute=False)
    get_placements = getattr(stack, "layer_placements", None)
    placements = get_placements() if get_placements is not None else None
    check_placements(placements, batch, parts, sequence_parallel=sequence_parallel)
    memory = CheckpointMemory() if memory is None else memory
    if offload is not None and not isinstance(offload, Offloader):
        raise TypeError(f"offload: expected an oases.offload.Offloader or None, got {type(offload).__name__}")
    if placements is not None:
        if offload is not None:
            raise ValueError("offload: not supported with per-layer tp_degrees; pass offload=None")
        return _train_step_placed(stack, placements, input_ids, labels, loss_sum, normalizer, plan, parts,
                                  comm, dropout_seed, attention_mask, memory)
    program, extra = _program, ()
    if sequence_parallel:
        params = _sequence_parallel_parameters(stack)
        before = [None if p.grad is None else p.grad.clone() for p in params]
        rank = 0 if comm.world_size == 1 else dist.get_rank(comm.group)
        threaded = plan.fine_grained_recompute and comm.has_thread
        program, extra = (_program_sp_fine if threaded else _program_sp), (rank,)
    programs = [
        program(stack, input_ids[r], labels[r],
                SubBatch(r, batch, dropout_seed, None if attention_mask is None else attention_mask[r]),
                loss_sum, normalizer, plan, comm,
                _Checkpoints(memory) if offload is None else _OffloadedCheckpoints(offload, k), *extra)
        for k, r in enumerate(split_rows(batch, parts))
    ]
    if offload is not None:
        offload.begin_step()
    loss = sum(interleave(programs, on_resume=comm.resumed)) / normalizer
    if offload is not None:
        memory.peak = max(memory.peak, offload.end_step().peak_resident_bytes)
    if sequence_parallel and comm.world_size > 1:
        _sum_over_group(params, before, comm)
    return loss


def _train_step_placed(stack: Stack, placements: LayerPlacements, input_ids, labels, loss_sum: LossSum,
                       normalizer: float, plan: Schedule, parts: int, comm: Communicator,
                       dropout_seed: Optional[int], attention_mask: Optional[torch.Tensor],
                       memory: CheckpointMemory) -> torch.Tensor:
    """train_step with per-layer TP degrees (see oases.schedule.protocol): the same programs, each
    layer on its own communicator; the replicas' gradient sums started as layers finish."""
    batch = input_ids.shape[0]
    placed = _PlacedStep(placements, parts)
    with placements.while_scheduled():
        placed.begin()
        try:
            programs = [
                _program(stack, input_ids[r], labels[r],
                         SubBatch(r, batch, dropout_seed, None if attention_mask is None else attention_mask[r]),
                         loss_sum, normalizer, plan, comm, _Checkpoints(memory), placed)
                for r in split_rows(batch, parts)
            ]
            loss = sum(interleave(programs)) / normalizer
            placed.finish()
        finally:
            placed.restore()
    return loss
