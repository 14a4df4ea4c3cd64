"""Communication mappings of tensor parallelism: two dual pairs of autograd functions and a self-adjoint one.

Each moves a tensor between the replicated region (every rank holds all of it) and the
tensor-parallel region (each rank holds a slice of the last dimension, or a partial sum). The
backward of each is the adjoint of its forward, so each mapping's backward is its dual's forward:

    copy_to_tp      fwd: identity                    bwd: all-reduce           dual: reduce_from_tp
    reduce_from_tp  fwd: all-reduce                  bwd: identity             dual: copy_to_tp
    split_to_tp     fwd: keep slice r of last dim    bwd: all-gather last dim  dual: gather_from_tp
    gather_from_tp  fwd: all-gather last dim         bwd: keep slice r         dual: split_to_tp
    sum_grads       a hook on parameters: .grad summed over the ranks (a whole parameter fed by this
                    rank's shard of the features: Qwen3's q_norm, an MoE router, a learned activation)
    sum_over_tp     fwd: all-reduce                  bwd: all-reduce           self-adjoint (a partial
                    sum every rank's output depends on: ShardedRMSNorm's sum of squares)
    copy_to_replicas  copy_to_tp on some rows: fwd identity, bwd all-reduce of the gradient's rows
                    in `spans` over the ranks holding copies of them (key-value heads at p > kv_heads)

    (p ranks, r this rank; x [..., h] replicated, x_r [..., h/p] this rank's slice)
    split_to_tp(x)      = x[..., r*h/p : (r+1)*h/p]
    gather_from_tp(x_r) = cat([x_0, ..., x_{p-1}], dim=-1)

The collectives are oases' ring collectives (`oases.comm`), so they run on gloo and NCCL alike.
The layers in `oases.nn.layers` use them where no fused op already does the communication.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases import comm
from oases.comm.topology import Ring, ring_of

__all__ = [
    "copy_to_tp",
    "reduce_from_tp",
    "split_to_tp",
    "gather_from_tp",
    "sum_over_tp",
    "lead_only",
    "grad_on_lead",
    "copy_to_replicas",
    "sum_grads",
]


def _all_reduced(t: torch.Tensor, ring: Ring) -> torch.Tensor:
    """A new tensor: the sum of `t` over the ring's ranks (`t` itself is left as it was)."""
    return comm.all_reduce(t.clone(memory_format=torch.contiguous_format), ring.group)


def _slice_last(t: torch.Tensor, ring: Ring) -> torch.Tensor:
    if t.shape[-1] % ring.size:
        raise ValueError(
            f"split_to_tp: the last dimension ({t.shape[-1]}) is not divisible by the tensor-parallel "
            f"world size {ring.size}; pad the features to a multiple of {ring.size}"
        )
    width = t.shape[-1] // ring.size
    return t.narrow(-1, ring.rank * width, width).clone(memory_format=torch.contiguous_format)  # never a view


def _gathered_last(t: torch.Tensor, ring: Ring) -> torch.Tensor:
    return comm.ring_all_gather(t, ring.group, dim=t.dim() - 1)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ring: Ring):
        ctx.ring = ring
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduced(grad, ctx.ring), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ring: Ring):
        return _all_reduced(x, ring)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SplitToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ring: Ring):
        ctx.ring = ring
        return _slice_last(x, ring)

    @staticmethod
    def backward(ctx, grad):
        return _gathered_last(grad.contiguous(), ctx.ring), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ring: Ring):
        ctx.ring = ring
        return _gathered_last(x, ring)

    @staticmethod
    def backward(ctx, grad):
        return _slice_last(grad, ctx.ring), None


@torch.compiler.disable  # a communicating op is one graph break under torch.compile, not several
def copy_to_tp(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """fwd: identity (x replicated); bwd: all-reduce of the gradient. Dual of reduce_from_tp."""
    return _CopyToTP.apply(x, ring_of(group))


@torch.compiler.disable  # a communicating op is one graph break under torch.compile, not several
def reduce_from_tp(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """fwd: all-reduce (sum of the ranks' partial x); bwd: identity. Dual of copy_to_tp."""
    return _ReduceFromTP.apply(x, ring_of(group))


@torch.compiler.disable  # a communicating op is one graph break under torch.compile, not several
def split_to_tp(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """fwd: keep this rank's slice of the last dim; bwd: all-gather the last dim. Dual of gather_from_tp."""
    return _SplitToTP.apply(x, ring_of(group))


@torch.compiler.disable  # a communicating op is one graph break under torch.compile, not several
def gather_from_tp(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """fwd: all-gather the last dim; bwd: keep this rank's slice of the gradient. Dual of split_to_tp."""
    return _GatherFromTP.apply(x, ring_of(group))


class _SumOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ring: Ring):
        ctx.ring = ring
        return _all_reduced(x, ring)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduced(grad, ctx.ring), None


@torch.compiler.disable  # a communicating op is one graph break under torch.compile, not several
def sum_over_tp(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """fwd: all-reduce (sum of the ranks' partial x); bwd: all-reduce of the gradient (self-adjoint:
    each rank's gradient is its share of the sum's, which depends on every rank's x)."""
    return _SumOverTP.apply(x, ring_of(group))


class _CopyToReplicas(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spans: tuple[tuple[int, int], ...], ring: Ring):
        ctx.spans, ctx.ring = spans, ring
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        for start, n in ctx.spans:
            comm.all_reduce(grad.narrow(0, start, n), ctx.ring.group)  # rows of dim 0: contiguous, in place
        return grad, None, None


@torch.compiler.disable  # a communicating op is one graph break under torch.compile, not several
def copy_to_replicas(
    x: torch.Tensor, spans: tuple[tuple[int, int], ...], group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """fwd: identity; bwd: the gradient's rows [start, start + n) of each span (dim 0) all-reduced
    over `group`, the other rows as they are. For a weight whose rows in `spans` every rank of
    `group` holds alike (a key-value head shared by their query heads): each rank's gradient of
    them is its query heads' share, so every copy gets the sum, the unsharded model's rows."""
    return _CopyToReplicas.apply(x, tuple(spans), ring_of(group))


# Local halves of a sum over the group (no communication here; a reduction follows or preceded):
#   lead_only(x)     fwd: x on the lead rank, zeros elsewhere    bwd: identity
#   grad_on_lead(x)  fwd: identity                               bwd: the gradient on the lead rank, zeros elsewhere
# (a replicated value entering a sum over the ranks counts once; a replicated gradient leaving one
# is counted once when the ranks' gradients are summed)


class _LeadOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lead: bool):
        return x if lead else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GradOnLead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lead: bool):
        ctx.lead = lead
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.lead else torch.zeros_like(grad)), None


def lead_only(x: torch.Tensor, lead: bool) -> torch.Tensor:
    """fwd: x where `lead` (this rank leads its group), zeros elsewhere; bwd: identity."""
    return _LeadOnly.apply(x, lead)


def grad_on_lead(x: torch.Tensor, lead: bool) -> torch.Tensor:
    """fwd: identity; bwd: the gradient where `lead`, zeros elsewhere."""
    return _GradOnLead.apply(x, lead)


def sum_grads(module: nn.Module, names: list[str], group: Optional[dist.ProcessGroup]) -> None:
    """Sum the gradients of `module`'s parameters `names` (dotted below it) over `group` as they are
    computed (a hook per parameter), and say so: each parameter's own module lists its leaf name in
    `tp_summed` (oases.summary shows the module as "summed")."""
    ring = ring_of(group)
    for name in names:
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        getattr(owner, leaf).register_hook(lambda grad: _all_reduced(grad, ring))
        owner.tp_summed = tuple(getattr(owner, "tp_summed", ())) + (leaf,)
