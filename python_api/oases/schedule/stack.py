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
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Generator, Mapping, Optional

import torch

from oases.schedule.protocol import Stack, SubBatch
from oases.schedule.runtime import BARRIER, Communicator, interleave

__all__ = ["SCHEDULES", "Schedule", "MAX_SUB_BATCHES", "train_step"]

MAX_SUB_BATCHES = 8


@dataclass(frozen=True)
class Schedule:
    """How a training step runs: the batch split along dim 0 into `sub_batches` interleaved
    programs (the default; train_step may override it); recomputation per sublayer from its
    input (no all-reduce) or per layer (all of it); programs held at each pass boundary or not."""

    sub_batches: int
    fine_grained_recompute: bool
    pass_barriers: bool


SCHEDULES: Mapping[str, Schedule] = MappingProxyType({
    "megatron": Schedule(sub_batches=1, fine_grained_recompute=False, pass_barriers=False),
    "merak": Schedule(sub_batches=2, fine_grained_recompute=False, pass_barriers=True),
    "cross_pass": Schedule(sub_batches=2, fine_grained_recompute=False, pass_barriers=False),
    "oases": Schedule(sub_batches=2, fine_grained_recompute=True, pass_barriers=False),
})

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
    x = x.detach().requires_grad_()
    with torch.enable_grad():
        h = sub.norm(x)
        h_leaf = h.detach().requires_grad_()
        part = sub.core(h_leaf, ctx)
    return _Recorded(x, h, h_leaf, part)


def _backward(sub, rec: _Recorded, grad_out: torch.Tensor, ctx: Any, comm: Communicator) -> Generator:
    """Gradient of x for x_out = x + finish(AR(part)) given grad_out; accumulates parameter grads."""
    z = torch.zeros_like(rec.part, requires_grad=True)  # stands for AR(part): finish is affine in it
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
             plan: Schedule, comm: Communicator) -> Generator:
    """One sub-batch's forward, loss and backward, yielding at each communication."""
    layers = [tuple(layer) for layer in stack.layers()]
    with torch.enable_grad():
        embedded, ctx = stack.embed(input_ids, where)
    x = embedded.detach()
    saved = []  # inputs of each recomputation sequence: per sublayer (oases) or per layer
    for layer in layers:
        for i, sub in enumerate(layer):
            if plan.fine_grained_recompute or i == 0:
                saved.append(x)
            with torch.no_grad():
                part = sub.core(sub.norm(x), ctx)
            x = yield from _finish_reduced(sub, x, part, ctx, comm, "forward")
    x = x.requires_grad_()
    with torch.enable_grad():
        loss = loss_sum(stack.head(x, ctx), labels)
        (loss / normalizer).backward()
    grad = x.grad
    if plan.pass_barriers:
        yield BARRIER
    for layer in reversed(layers):
        if plan.fine_grained_recompute:
            for sub in reversed(layer):
                grad = yield from _backward(sub, _record(sub, saved.pop(), ctx), grad, ctx, comm)
            continue
        x_in, records = saved.pop(), []
        for sub in layer:  # activation checkpointing reruns the whole layer, its all-reduces included
            rec = _record(sub, x_in, ctx)
            records.append(rec)
            x_in = yield from _finish_reduced(sub, x_in, rec.part.detach().clone(), ctx, comm, "recompute")
        if plan.pass_barriers:
            yield BARRIER
        for sub, rec in zip(reversed(layer), reversed(records)):
            grad = yield from _backward(sub, rec, grad, ctx, comm)
        if plan.pass_barriers:
            yield BARRIER
    embedded.backward(grad)
    return loss.detach()


def split_rows(batch: int, parts: int) -> list[slice]:
    """`parts` contiguous row ranges covering `batch` rows, sizes differing by at most one (3 -> 2 + 1)."""
    bounds = [batch * i // parts for i in range(parts + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def train_step(stack: Stack, input_ids: torch.Tensor, labels: torch.Tensor, *, loss_sum: LossSum,
               normalizer: float, comm: Communicator, schedule: str = "oases",
               sub_batches: Optional[int] = None, dropout_seed: Optional[int] = None,
               attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Forward and backward of sum(loss_sum(logits, labels)) / normalizer on `schedule`.

        for rows in split(batch, sub_batches):                # interleaved, see the module docstring
            loss += loss_sum(stack.head(stack_forward(input_ids[rows])), labels[rows]) / normalizer
        parameter .grad += d loss / d parameter;  return loss (a detached scalar)
    `sub_batches` None takes the schedule's own (megatron 1, the others 2); odd batches split
    unevenly (3 -> 2 + 1). `comm` issues and counts the all-reduces on the TP group. Checks run
    before any communication, so a bad argument raises on every rank alike.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: {schedule!r} is not one of {sorted(SCHEDULES)}")
    plan = SCHEDULES[schedule]
    parts = plan.sub_batches if sub_batches is None else sub_batches
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
    programs = [
        _program(stack, input_ids[r], labels[r],
                 SubBatch(r, batch, dropout_seed, None if attention_mask is None else attention_mask[r]),
                 loss_sum, normalizer, plan, comm)
        for r in split_rows(batch, parts)
    ]
    return sum(interleave(programs)) / normalizer
