"""Training schedules for a stack of TP sublayers `x = x + finish(all_reduce(core(norm(x))))`.

The model (see oases.models.gpt) provides `embed_tokens`, `sublayers()` (each with `norm`, `core`,
`finish`, two per block), `head_loss_sum` and a `comm` (oases.schedule.runtime.Communicator).

    schedule    sub-batches  recomputation             pass barriers   all-reduces per layer
    megatron    1            full, per layer (with AR)  -               6 (2 fwd, 2 recompute, 2 bwd)
    merak       2            full, per layer (with AR)  yes             6, each as 2 half-size
    cross_pass  2            full, per layer (with AR)  no              6, each as 2 half-size
    oases       2            per sublayer, no AR        no              4, each as 2 half-size

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
from typing import Generator, Mapping, Optional

import torch

from oases.schedule.runtime import BARRIER, interleave

__all__ = ["SCHEDULES", "Schedule", "train_step"]


@dataclass(frozen=True)
class Schedule:
    """How a training step runs: the batch split along dim 0 into `sub_batches` interleaved
    programs; recomputation per sublayer from its input (no all-reduce) or per layer (all of it);
    programs held at each pass boundary or not."""

    sub_batches: int
    fine_grained_recompute: bool
    pass_barriers: bool


SCHEDULES: Mapping[str, Schedule] = MappingProxyType({
    "megatron": Schedule(sub_batches=1, fine_grained_recompute=False, pass_barriers=False),
    "merak": Schedule(sub_batches=2, fine_grained_recompute=False, pass_barriers=True),
    "cross_pass": Schedule(sub_batches=2, fine_grained_recompute=False, pass_barriers=False),
    "oases": Schedule(sub_batches=2, fine_grained_recompute=True, pass_barriers=False),
})


@dataclass
class _Recorded:
    """One sublayer's recomputed graph: x -> h = norm(x) | h' (leaf) -> part = core(h')."""

    x: torch.Tensor
    h: torch.Tensor
    h_leaf: torch.Tensor
    part: torch.Tensor


@dataclass(frozen=True)
class _Rows:
    """Where a sub-batch sits in the batch (for dropout masks drawn over the whole batch)."""

    rows: slice
    batch: int
    seed: Optional[int]


def _record(sub, x: torch.Tensor) -> _Recorded:
    x = x.detach().requires_grad_()
    with torch.enable_grad():
        h = sub.norm(x)
        h_leaf = h.detach().requires_grad_()
        part = sub.core(h_leaf)
    return _Recorded(x, h, h_leaf, part)


def _backward(sub, rec: _Recorded, grad_out: torch.Tensor, where: _Rows, comm) -> Generator:
    """Gradient of x for x_out = x + finish(AR(part)) given grad_out; accumulates parameter grads."""
    z = torch.zeros_like(rec.part, requires_grad=True)  # stands for AR(part): finish is affine in it
    with torch.enable_grad():
        sub.finish(z, where.seed, where.rows, where.batch).backward(grad_out)
    rec.part.backward(z.grad)  # AR's adjoint is the identity: grad(part) = grad(AR(part))
    grad_h = rec.h_leaf.grad  # this rank's heads / features only: sum over ranks
    work = comm.all_reduce(grad_h, "backward")
    yield
    work.wait()
    rec.h.backward(grad_h)
    return grad_out + rec.x.grad


def _finish_reduced(sub, x: torch.Tensor, part: torch.Tensor, where: _Rows, comm, phase: str) -> Generator:
    """x + finish(all_reduce(part)); all-reduces `part` in place (not a tensor autograd saved)."""
    work = comm.all_reduce(part, phase)
    yield
    work.wait()
    with torch.no_grad():
        return x + sub.finish(part, where.seed, where.rows, where.batch)


def _program(model, tokens, targets, total_tokens: int, where: _Rows, plan: Schedule) -> Generator:
    """One sub-batch's forward, loss and backward, yielding at each communication."""
    comm, subs = model.comm, model.sublayers()
    with torch.enable_grad():
        embedded = model.embed_tokens(tokens)
    x = embedded.detach()
    saved = []  # inputs of each recomputation sequence: per sublayer (oases) or per block
    for i, sub in enumerate(subs):
        if plan.fine_grained_recompute or i % 2 == 0:
            saved.append(x)
        with torch.no_grad():
            part = sub.core(sub.norm(x))
        x = yield from _finish_reduced(sub, x, part, where, comm, "forward")
    x = x.requires_grad_()
    with torch.enable_grad():
        loss_sum = model.head_loss_sum(x, targets)
        (loss_sum / total_tokens).backward()
    grad = x.grad
    if plan.pass_barriers:
        yield BARRIER
    for block in reversed(range(len(subs) // 2)):
        attn, mlp = subs[2 * block], subs[2 * block + 1]
        if plan.fine_grained_recompute:
            grad = yield from _backward(mlp, _record(mlp, saved.pop()), grad, where, comm)
            grad = yield from _backward(attn, _record(attn, saved.pop()), grad, where, comm)
            continue
        x0 = saved.pop()
        rec_attn = _record(attn, x0)
        x1 = yield from _finish_reduced(attn, x0, rec_attn.part.detach().clone(), where, comm, "recompute")
        rec_mlp = _record(mlp, x1)
        # Activation checkpointing reruns the whole layer, its second all-reduce included.
        yield from _finish_reduced(mlp, x1, rec_mlp.part.detach().clone(), where, comm, "recompute")
        if plan.pass_barriers:
            yield BARRIER
        grad = yield from _backward(mlp, rec_mlp, grad, where, comm)
        grad = yield from _backward(attn, rec_attn, grad, where, comm)
        if plan.pass_barriers:
            yield BARRIER
    embedded.backward(grad)
    return loss_sum.detach()


def train_step(model, tokens: torch.Tensor, targets: torch.Tensor, *, schedule: str = "oases",
               dropout_seed: Optional[int] = None) -> torch.Tensor:
    """Forward and backward of mean(cross_entropy(model(tokens), targets)) on `schedule`.

        loss = mean over all b*t tokens; parameter .grad += d loss / d parameter
    The batch is split into `SCHEDULES[schedule].sub_batches` parts along dim 0 (odd sizes
    unevenly: 3 -> 2 + 1). Returns the loss (a detached scalar).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: {schedule!r} is not one of {sorted(SCHEDULES)}")
    if tokens.shape != targets.shape:
        raise ValueError(f"targets: shape {tuple(targets.shape)} differs from tokens' {tuple(tokens.shape)}")
    plan = SCHEDULES[schedule]
    batch = tokens.shape[0]
    if batch < plan.sub_batches:
        raise ValueError(f"tokens: schedule {schedule!r} splits the batch into {plan.sub_batches} "
                         f"sub-batches; got batch size {batch} (use at least {plan.sub_batches})")
    bounds = [batch * i // plan.sub_batches for i in range(plan.sub_batches + 1)]
    rows = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    programs = [
        _program(model, tokens[r], targets[r], targets.numel(), _Rows(r, batch, dropout_seed), plan)
        for r in rows
    ]
    return sum(interleave(programs)) / targets.numel()
