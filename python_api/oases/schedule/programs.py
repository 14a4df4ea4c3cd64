"""One sub-batch's forward, loss and backward as a program that yields at each communication.

Fine-grained recomputation ("oases") keeps each sublayer's input, so recomputing starts after an
all-reduce and never repeats one: the gradient of an all-reduce's input is its output's gradient.
The column-parallel input's gradient (the "copy" dual) is the all-reduce of the backward pass.

    cross_pass / oases, backward of one layer (A, B: sub-batches):
      compute: | A: recompute+bwd mlp | B: recompute+bwd mlp | A: attn | B: attn | A: next layer ...
      comm   :                        | A: AR grad           | B: AR   | A: AR   | B: AR ...
    merak holds A at the end of each pass until B gets there (B's last all-reduce is exposed).

Per-layer TP degrees (oases.schedule.placed) run the same program with each layer on its own
Communicator and its replica's rows, the rows moved at the layer boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generator, Optional, Protocol

import torch
import torch.distributed as dist

from oases._leaves import grad_leaf
from oases.comm.topology import same_group
from oases.nn.mappings import reduce_from_tp
from oases.schedule.placed import move_rows, move_rows_adjoint
from oases.schedule.protocol import Stack, SubBatch
from oases.schedule.runtime import BARRIER, Communicator
from oases.schedule.selective import explained
from oases.schedule.selective import selective as _selective
from oases.schedule.table import FULL, SELECTIVE, LossSum, Schedule, _RecomputeInputs

if TYPE_CHECKING:
    from oases.schedule.placed import PlacedStep


@dataclass
class _Recorded:
    """One sublayer's recomputed graph: x -> h = norm(x) | h' (leaf) -> part = core(h')."""

    x: torch.Tensor
    h: torch.Tensor
    h_leaf: torch.Tensor
    part: torch.Tensor


def core_for_gradients(sub) -> Any:
    """The sublayer's `core_for_gradients` (its graph for a backward only, the output's value
    unread: see oases.schedule.protocol), or its `core` where it has none."""
    return getattr(sub, "core_for_gradients", sub.core)


def _record(sub, x: torch.Tensor, ctx: Any, selective: bool = False, read: bool = True) -> _Recorded:
    """The sublayer's graph from `x`; `selective`: saving only its GEMMs' and attention's outputs
    (oases.schedule.selective; the norm is rerun from x); `read` False: only differentiated, so
    `part`'s value may be left out (core_for_gradients)."""
    x = grad_leaf(x)  # (not cached by autocast: see oases._leaves)
    with torch.enable_grad():
        h = _selective(sub.norm, x) if selective else sub.norm(x)
        h_leaf = grad_leaf(h)
        core = sub.core if read else core_for_gradients(sub)
        part = _selective(core, h_leaf, ctx) if selective else core(h_leaf, ctx)
    return _Recorded(x, h, h_leaf, part)


def _backward(sub, rec: _Recorded, grad_out: torch.Tensor, ctx: Any, comm: Communicator) -> Generator:
    """Gradient of x for x_out = x + finish(AR(part)) given grad_out; accumulates parameter grads."""
    z = grad_leaf(torch.zeros_like(rec.part))  # stands for AR(part): finish is affine in it
    with torch.enable_grad():
        sub.finish(z, ctx).backward(grad_out)
    with explained():  # (selective graphs: a saved output changed in place is refused here)
        rec.part.backward(z.grad)  # AR's adjoint is the identity: grad(part) = grad(AR(part))
    grad_h = rec.h_leaf.grad  # this rank's heads / features only: sum over ranks
    if grad_h is None:  # core ignores its input (no column-parallel path): nothing to reduce
        grad_h = torch.zeros_like(rec.h_leaf)
    work = comm.all_reduce(grad_h, "backward")
    yield
    work.wait()
    rec.h.backward(grad_h)
    return grad_out + rec.x.grad


class _Summed(torch.autograd.Function):
    """`summed` (the all-reduce of `partial`, made outside autograd) with partial's graph behind
    it: the all-reduce's adjoint is the identity. Nothing is saved: partial is freed."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, summed: torch.Tensor) -> torch.Tensor:
        return summed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _summed_over(t: torch.Tensor, group: Optional[dist.ProcessGroup], comm: Communicator, phase: str) -> Generator:
    """-> t summed over `group`: in place on `comm`, yielded across, where comm's group is `group`
    at its size; else blocking there (as the layer itself would sum it)."""
    if not dist.is_initialized() or (same_group(comm.group, group) and comm.world_size == dist.get_world_size(group)):
        work = comm.all_reduce(t, phase)
        yield
        work.wait()
        return t
    return reduce_from_tp(t, group)


def _embed(stack: Stack, input_ids, where: SubBatch, comm: Communicator) -> Generator:
    """-> (x, ctx) = stack.embed(input_ids, where), x with its graph; its vocabulary-parallel
    all-reduce (where the stack splits around it: embed_split) started on `comm` and yielded across."""
    split = getattr(stack, "embed_split", None)
    with torch.enable_grad():
        parts = split(input_ids, where) if split is not None else None
        if parts is None:
            return stack.embed(input_ids, where)
    summed = parts.partial.detach().clone(memory_format=torch.contiguous_format)  # summed in place
    summed = yield from _summed_over(summed, parts.group, comm, "forward")
    with torch.enable_grad():
        return parts.then(_Summed.apply(parts.partial, summed))


def _head_loss(
    stack: Stack, x: torch.Tensor, ctx: Any, loss_sum: LossSum, labels, normalizer: float, comm: Communicator
) -> Generator:
    """-> (loss, grad of x): loss = loss_sum(stack.head(x, ctx), labels), backward from loss /
    normalizer; a vocabulary-parallel head's all-reduce of its input's gradient (where the stack
    splits around it: head_split) started on `comm` and yielded across."""
    x = grad_leaf(x)
    split = getattr(stack, "head_split", None)
    with torch.enable_grad():
        parts = split(x, ctx) if split is not None else None
        if parts is None:
            loss = loss_sum(stack.head(x, ctx), labels)
            (loss / normalizer).backward()
            return loss, x.grad
        h = grad_leaf(parts.h)
        loss = loss_sum(parts.logits_of(h), labels)
        (loss / normalizer).backward()
    grad_h = h.grad if h.grad is not None else torch.zeros_like(h)  # this rank's share
    grad_h = yield from _summed_over(grad_h, parts.group, comm, "backward")
    if parts.h.requires_grad:
        parts.h.backward(grad_h)
    return loss, x.grad


def _finish_reduced(sub, x: torch.Tensor, part: torch.Tensor, ctx: Any, comm: Communicator, phase: str) -> Generator:
    """x + finish(all_reduce(part)); all-reduces `part` in place (not a tensor autograd saved)."""
    work = comm.all_reduce(part, phase)
    yield
    work.wait()
    with torch.no_grad():
        return x + sub.finish(part, ctx)


def layer_backward(
    layer,
    grad: torch.Tensor,
    sched: Schedule,
    saved: _RecomputeInputs,
    passes: "LayerPasses",
    kept: Optional[list[_Recorded]] = None,
    mode: str = FULL,
) -> Generator:
    """The gradient of one layer's input given its output's, `grad`; accumulates parameter grads.
    The one backward loop of every program: `passes` says how a sublayer's graph is recorded, rerun
    and differentiated with its communication (plain all-reduces, or sequence parallelism's)::

        kept (mode KEEP / SELECTIVE): rec = the sublayer's graph kept by the forward
        per sublayer (fine-grained): rec = passes.record(sub, saved input, read=False)
                                     (part's value unread: core_for_gradients)
            then, per sublayer in reverse: grad = passes.backward(sub, rec, grad)
        per layer: rerun the layer from its saved input, recording each sublayer and redoing its
                   communication (passes.rerun); then backward through the sublayers in reverse
    """
    if mode != FULL or sched.fine_grained_recompute:
        for sub in reversed(layer):
            rec = kept.pop() if mode != FULL else (yield from passes.record(sub, saved.pop(), read=False))
            grad = yield from passes.backward(sub, rec, grad)
        return grad
    x_in, records = saved.pop(), []
    for sub in layer:  # activation checkpointing reruns the whole layer, its communication included
        rec = yield from passes.record(sub, x_in, read=True)  # rerun reduces its part
        records.append(rec)
        x_in = yield from passes.rerun(sub, x_in, rec)
    if sched.pass_barriers:
        yield BARRIER
    for sub, rec in zip(reversed(layer), reversed(records)):
        grad = yield from passes.backward(sub, rec, grad)
    if sched.pass_barriers:
        yield BARRIER
    return grad


class LayerPasses(Protocol):
    """How layer_backward records, reruns and differentiates a sublayer (generators: they yield at
    each communication)."""

    def record(self, sub, x: torch.Tensor, read: bool) -> Generator:
        """-> the sublayer's graph (_Recorded) rerun from its input `x` with autograd; `read`
        False: its part is only differentiated, never read (core_for_gradients may serve)."""

    def rerun(self, sub, x: torch.Tensor, rec: _Recorded) -> Generator:
        """-> the sublayer's output from `x` and its recorded core output, its communication redone."""

    def backward(self, sub, rec: _Recorded, grad: torch.Tensor) -> Generator:
        """-> the gradient of the sublayer's input given its output's `grad` (parameter grads accumulate)."""


@dataclass(frozen=True)
class _Plain:
    """The passes of a replicated residual stream: all-reduces on `comm`, ctx `ctx`."""

    ctx: Any
    comm: Communicator

    def record(self, sub, x: torch.Tensor, read: bool) -> Generator:
        return _record(sub, x, self.ctx, read=read)
        yield  # a generator that communicates nothing

    def rerun(self, sub, x: torch.Tensor, rec: _Recorded) -> Generator:
        return (yield from _finish_reduced(sub, x, rec.part.detach().clone(), self.ctx, self.comm, "recompute"))

    def backward(self, sub, rec: _Recorded, grad: torch.Tensor) -> Generator:
        return (yield from _backward(sub, rec, grad, self.ctx, self.comm))


def _program(
    stack: Stack,
    input_ids,
    labels,
    where: SubBatch,
    loss_sum: LossSum,
    normalizer: float,
    sched: Schedule,
    comm: Communicator,
    saved: _RecomputeInputs,
    placed: Optional["PlacedStep"] = None,
) -> Generator:
    """One sub-batch's forward, loss and backward, yielding at each communication. `placed`:
    per-layer TP degrees (each layer on its own communicator and its replica's rows, the rows
    moved at the layer boundaries; see oases.schedule.protocol)."""
    layers = [tuple(layer) for layer in stack.layers()]
    embedded, ctx = yield from _embed(stack, input_ids, where, comm)
    x, rows = embedded.detach(), embedded.shape[0]  # x [rows, t, h]
    if placed is None:
        comms, ctxs, moves, move_out = [comm] * len(layers), [ctx] * len(layers), [None] * len(layers), None
    else:
        comms, ctxs, moves, move_out = placed.per_layer(stack, ctx, rows)
    # saved: inputs of each recomputation sequence, per sublayer (oases) or per layer; kept: each
    # sublayer's forward graph instead, without recomputation
    kept: list[_Recorded] = []
    for index, (layer, c, lctx, move) in enumerate(zip(layers, comms, ctxs, moves)):
        if move is not None:  # the boundary between layers of different degrees: this replica's rows
            x = yield from move_rows(move, x, rows, "forward")
        mode = sched.mode(index)
        for i, sub in enumerate(layer):
            if mode != FULL:  # the graph kept for the backward (autograd's activations held)
                rec = _record(sub, x, lctx, mode == SELECTIVE)
                kept.append(rec)
                part = rec.part.detach().clone()  # reduced in place: not a tensor the graph holds
            else:
                if sched.fine_grained_recompute or i == 0:
                    saved.push(x)
                with torch.no_grad():
                    part = sub.core(sub.norm(x), lctx)
            x = yield from _finish_reduced(sub, x, part, lctx, c, "forward")
    if move_out is not None:  # the head runs on every row of the sub-batch
        x = yield from move_rows(move_out, x, rows, "forward")
    saved.flush()  # offloading: the last inputs leave too, the first needed start coming back
    loss, grad = yield from _head_loss(stack, x, ctx, loss_sum, labels, normalizer, comm)
    if move_out is not None:
        grad = yield from move_rows_adjoint(move_out, grad, rows)
    if sched.pass_barriers:
        yield BARRIER
    for index in reversed(range(len(layers))):
        layer, c, lctx = layers[index], comms[index], ctxs[index]
        grad = yield from layer_backward(layer, grad, sched, saved, _Plain(lctx, c), kept, sched.mode(index))
        if placed is not None:
            placed.layer_done(index)  # the last sub-batch through it starts the replicas' gradient sum
            if moves[index] is not None:
                grad = yield from move_rows_adjoint(moves[index], grad, rows)
    if embedded.requires_grad:  # a frozen embedding has nothing to learn
        embedded.backward(grad)
    return loss.detach()
