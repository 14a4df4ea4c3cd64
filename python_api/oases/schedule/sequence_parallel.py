"""Sequence-parallel programs: x is this rank's [b, t/p, h] slice of the sequence (dim 1)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Generator, Optional

import torch

from oases._leaves import grad_leaf
from oases.schedule.programs import _embed, _head_loss, _Recorded, core_for_gradients, layer_backward
from oases.schedule.protocol import Stack, SubBatch, with_tokens
from oases.schedule.runtime import BARRIER, Communicator
from oases.schedule.table import LossSum, Schedule, _RecomputeInputs

#
#   forward of a sublayer:  h_r = norm(x_r); h = all_gather(h_r); z_r = reduce_scatter(core(h))
#                           x_r = x_r + finish(z_r)
#   backward (adjoints):    g_z = all_gather(grad finish); core backward -> g_h
#                           g_h_r = reduce_scatter(g_h); norm backward -> grad x_r
#   fine-grained recomputation keeps x_r (1/p of the sublayer input) and re-gathers h_r.

_SEQ = -2  # the sequence dimension: x [b, t, h] (and a stacked norm output [k, b, t, h])


def _record_sp(sub, x_r: torch.Tensor, ctx: Any, comm: Communicator, phase: str, read: bool) -> Generator:
    """Rerun norm, the gather and core with autograd: the graph of one sublayer (sequence parallel);
    `read` False: part only differentiated (core_for_gradients)."""
    x_r = grad_leaf(x_r)
    with torch.enable_grad():
        h_r = sub.norm(x_r)
    h = yield from comm.all_gather(h_r.detach(), _SEQ, phase)
    h_leaf = grad_leaf(h)
    with torch.enable_grad():
        part = (sub.core if read else core_for_gradients(sub))(h_leaf, ctx)
    return _Recorded(x_r, h_r, h_leaf, part)


def _forward_sp(
    sub, x_r: torch.Tensor, ctx: Any, comm: Communicator, phase: str, part: Optional[torch.Tensor] = None
) -> Generator:
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


@dataclass(frozen=True)
class _SequenceParallel:
    """The passes of a sequence-parallel residual stream (see layer_backward): gathers and
    scatters on `comm`, for this rank's `tokens`."""

    tokens: Any
    comm: Communicator

    def record(self, sub, x_r: torch.Tensor, read: bool) -> Generator:
        return (yield from _record_sp(sub, x_r, self.tokens, self.comm, "recompute", read))

    def rerun(self, sub, x_r: torch.Tensor, rec: _Recorded) -> Generator:
        return (yield from _forward_sp(sub, x_r, self.tokens, self.comm, "recompute", rec.part.detach()))

    def backward(self, sub, rec: _Recorded, grad: torch.Tensor) -> Generator:
        return (yield from _backward_sp(sub, rec, grad, self.tokens, self.comm))


def _program_sp(
    stack: Stack,
    input_ids,
    labels,
    where: SubBatch,
    loss_sum: LossSum,
    normalizer: float,
    sched: Schedule,
    comm: Communicator,
    saved: _RecomputeInputs,
    rank: int,
) -> Generator:
    """`_program` with the residual stream split along the sequence over the TP ranks."""
    layers = [tuple(layer) for layer in stack.layers()]
    embedded, ctx, tokens, mine = yield from _embed_sharded(stack, input_ids, where, comm, rank)
    x = embedded.detach()[:, mine].contiguous()  # [b, t/p, h]
    for layer in layers:
        for i, sub in enumerate(layer):
            if sched.fine_grained_recompute or i == 0:
                saved.push(x)
            x = yield from _forward_sp(sub, x, tokens, comm, "forward")
    saved.flush()
    x_full = yield from comm.all_gather(x, _SEQ, "forward")  # the head sees every token, as without SP
    loss, grad_full = yield from _head_loss(stack, x_full, ctx, loss_sum, labels, normalizer, comm)
    grad = grad_full[:, mine]  # the head ran alike on every rank: this rank's tokens' gradient
    if sched.pass_barriers:
        yield BARRIER
    passes = _SequenceParallel(tokens, comm)
    for layer in reversed(layers):
        grad = yield from layer_backward(layer, grad, sched, saved, passes)
    grad_full = yield from comm.all_gather(grad.contiguous(), _SEQ, "backward")  # the split's adjoint
    if embedded.requires_grad:
        embedded.backward(grad_full)
    return loss.detach()


def _program_sp_fine(
    stack: Stack,
    input_ids,
    labels,
    where: SubBatch,
    loss_sum: LossSum,
    normalizer: float,
    sched: Schedule,
    comm: Communicator,
    saved: _RecomputeInputs,
    rank: int,
) -> Generator:
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
    embedded, ctx, tokens, mine = yield from _embed_sharded(stack, input_ids, where, comm, rank)
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
    loss, grad_full = yield from _head_loss(stack, x_full, ctx, loss_sum, labels, normalizer, comm)
    grad = grad_full[:, mine]  # the head ran alike on every rank: this rank's tokens' gradient
    task = comm.submit(functools.partial(_between_backward, None, subs[-1], grad, saved.pop(), tokens, comm))
    yield
    for i in reversed(range(len(subs))):
        grad_part, h, x_leaf, h_r, grad = task.wait()
        h_leaf = grad_leaf(h)
        with torch.enable_grad():
            part = core_for_gradients(subs[i])(h_leaf, tokens)  # only differentiated
        part.backward(grad_part)
        grad_h = h_leaf.grad if h_leaf.grad is not None else torch.zeros_like(h_leaf)
        earlier = subs[i - 1] if i > 0 else None
        task = comm.submit(
            functools.partial(
                _between_backward, (grad_h, x_leaf, h_r), earlier, grad, saved.pop() if i > 0 else None, tokens, comm
            )
        )
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


def _embed_sharded(stack: Stack, input_ids, where: SubBatch, comm: Communicator, rank: int) -> Generator:
    """-> (embedded [b, t, h] with its graph, ctx, ctx for this rank's tokens, their slice of t)."""
    embedded, ctx = yield from _embed(stack, input_ids, where, comm)  # every rank alike
    t = embedded.shape[_SEQ]
    n = t // comm.world_size
    mine = slice(rank * n, (rank + 1) * n)
    return embedded, ctx, with_tokens(ctx, where.tokens(mine, t)), mine


def sequence_parallel_parameters(stack: Stack) -> list[torch.Tensor]:
    """The parameters of the stack's sublayers that see a sequence slice per TP rank (norms, row
    biases): train_step sums their gradients over the TP group after the step's backwards."""
    found: dict[int, torch.Tensor] = {}
    for layer in stack.layers():
        for sub in layer:
            get = getattr(sub, "sequence_parallel_parameters", None)
            if get is None:
                raise ValueError(
                    f"sequence_parallel: {type(sub).__name__} has no sequence_parallel_parameters() "
                    "(the parameters its norm and finish use; see oases.schedule.protocol)"
                )
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
        summed = flat[offset : offset + count].view_as(p.grad)
        p.grad.copy_(summed if b is None else b + summed)
        offset += count
