"""The gradient invariant of tensor parallelism: what ranks hold alike, they hold with the same gradient.

A parameter left whole on every rank of a TP group (a norm, a bias added after the reduction, a
router) must end each backward with the same gradient on every rank: the unsharded model's. A
rank holding a partial gradient (a parameter that sees only this rank's shard of the features and
whose gradient nothing sums: a learned activation, a gate on the inner features, a hook scaling a
shard with a parameter parallelize cannot see) trains a different model on each rank, silently.
`check_gradients` compares small digests of every such gradient across the ranks:

    for each parameter q whole over the TP group (no module's tp_layout() lists it):
        digest(q) = (has a grad, |g|_2, <g, u_q>)        u_q: a fixed random unit vector (same on every rank)
    lo, hi = all_reduce(MIN / MAX, digest) over the TP group       (one all-reduce of 6 numbers per parameter)
    mismatch: |g| spread > rtol * max |g|_2 + atol, <g, u> spread > rtol * max |g|_2 / sqrt(numel) + atol
              (a difference spread over n entries moves <g, u> by about its norm / sqrt(n)),
              or a gradient on some ranks only
    over `dp_group` too (every parameter, after a data-parallel sync: replicas hold the same shards)
    any mismatch -> RuntimeError on every rank, naming each parameter with its spread and the likely cause

Tolerance, relative to the gradient's norm: rtol 1e-5 for fp32 / fp64 gradients and 1e-2 for
16-bit ones (CUDA's backward is not bitwise deterministic: atomics reorder sums; on CPU the ranks'
whole gradients are bitwise equal). A partial gradient is off by a factor of order one where the
wrong path dominates, by a smaller share of the norm where it touches few entries (a hook scaling
one head by one entry of a norm's weight: 1e-3 of that weight's gradient norm).

Cost: one pass over the gradients (a dot product each, the random vector drawn a parameter at a
time) and one all-reduce of 6 floats per parameter per group, timed by `python -m bench layers`
(t_grad_check). oases.train_step runs it on a model's first step by default.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases._sharding import sharded_parameters
from oases.nn.parallelism import parallelism_of

__all__ = ["check_gradients", "DEFAULT_RTOL"]

DEFAULT_RTOL = {torch.float64: 1e-5, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
_SEED = 0x0A5E5


_TP_MISMATCH = (
    "{count} whole parameter(s) end the backward with different gradients on the ranks of the tensor-parallel "
    "group (each rank should hold the unsharded model's): {names}. Likely cause: the parameter sees only this "
    "rank's shard of the features (a learned activation, a gate or scale between a column and a row layer, a hook "
    "that uses a parameter parallelize cannot see), so each rank's gradient is a partial sum; move it into a "
    "module parallelize places (an activation's parameters are summed over the group, per-feature ones sharded: "
    "see oases.summary), or leave that module's projections out of the plan"
)
_DP_MISMATCH = (
    "{count} parameter(s) end the step with different gradients on the data-parallel replicas: {names}. Likely "
    "cause: a parameter outside the gradient sync's buckets, or a sync that did not finish before the check"
)


def _tp_group(model: nn.Module) -> Optional[dist.ProcessGroup]:
    """The group the model's whole parameters are replicated over: its one TP group, the world
    with per-layer degrees (whole parameters summed over replicas) or several groups; None: TP 1."""
    groups = []
    for group in sharded_parameters(model).values():
        if not any(group is g for g in groups):
            groups.append(group)
    if not groups:
        return None
    made = parallelism_of(model)
    per_layer = made is not None and made.layer_degrees is not None
    return groups[0] if len(groups) == 1 and not per_layer else dist.group.WORLD


def _digests(params: list[tuple[str, nn.Parameter]], device: torch.device) -> torch.Tensor:
    """[n, 3] float64: (has a grad, |g|, <g, u>) per parameter, u a unit vector drawn from its index."""
    out = torch.zeros(len(params), 3, dtype=torch.float64, device=device)
    for i, (_, q) in enumerate(params):
        g = q.grad
        if g is None:
            continue
        flat = g.detach().reshape(-1).float()
        gen = torch.Generator(device=flat.device).manual_seed(_SEED + i)
        u = torch.rand(flat.numel(), generator=gen, device=flat.device, dtype=torch.float32) - 0.5
        u = u / u.norm().clamp_min(1e-30)
        out[i, 0] = 1.0
        out[i, 1] = flat.double().norm().to(device)
        out[i, 2] = torch.dot(flat, u).double().to(device)
    return out


def _spread(digests: torch.Tensor, group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, min) of the digests over the group's ranks: one all-reduce (MAX of [d, -d])."""
    both = torch.cat([digests, -digests], dim=1)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return both[:, :3], -both[:, 3:]


def _mismatches(
    params: list[tuple[str, nn.Parameter]], hi: torch.Tensor, lo: torch.Tensor, rtol: Optional[float], atol: float
) -> list[str]:
    found = []
    for i, (name, q) in enumerate(params):
        if hi[i, 0] != lo[i, 0]:
            found.append(f"{name} (a gradient on some ranks only)")
            continue
        if hi[i, 0] == 0:
            continue
        tol = (DEFAULT_RTOL.get(q.grad.dtype, 1e-2) if rtol is None else rtol) * float(hi[i, 1])
        # <d, u> of a difference d spread over n entries is about |d| / sqrt(n): its tolerance likewise
        if float(hi[i, 1] - lo[i, 1]) > tol + atol or float(hi[i, 2] - lo[i, 2]) > tol / q.numel() ** 0.5 + atol:
            found.append(f"{name} (|grad| {float(lo[i, 1]):.4g} .. {float(hi[i, 1]):.4g} over the ranks)")
    return found


def check_gradients(
    model: nn.Module,
    *,
    group: Optional[dist.ProcessGroup] = None,
    dp_group: Optional[dist.ProcessGroup] = None,
    rtol: Optional[float] = None,
    atol: float = 0.0,
) -> None:
    """Raise on every rank if a gradient that ranks should hold alike differs between them (module doc).

    ::

        whole = parameters no tp_layout() lists            # replicated over the TP group
        for ranks in group: digests of whole gradients agree within rtol * |g| + atol
        for ranks in dp_group: digests of every gradient agree (after the DP sync)

    Call it on every rank after the backward (and after any gradient sync), before the optimizer
    step: `loss.backward(); oases.check_gradients(model); optimizer.step()`.

    Args:
        model: the parallelized model (oases.parallelize, oases.models.GPT, ...).
        group: the group whose ranks hold the whole parameters alike (None: the model's TP group;
            the world for a model with per-layer tp_degrees).
        dp_group: a data-parallel group whose replicas hold the same parameters (None: no DP check).
        rtol: the relative tolerance on each gradient's digest (None: by its dtype, DEFAULT_RTOL).
        atol: an absolute tolerance added to it.

    Raises:
        RuntimeError: on every rank, naming the parameters whose gradients differ and the likely cause.
        TypeError: `model` is not an nn.Module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        return
    seen, params = set(), []
    for name, q in model.named_parameters():
        if id(q) not in seen:
            seen.add(id(q))
            params.append((name, q))
    sharded = sharded_parameters(model)
    tp = group if group is not None else _tp_group(model)
    # the digests' device from the groups' backend, never from this rank's gradients (which it may lack):
    # every rank the same, NCCL's on the current CUDA device
    nccl = any(g is not None and "nccl" in str(dist.get_backend(g)) for g in (tp, dp_group))
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    whole = [(n, q) for n, q in params if id(q) not in sharded]
    problems = []
    for ranks, checked, what in ((tp, whole, _TP_MISMATCH), (dp_group, params, _DP_MISMATCH)):
        if ranks is None or dist.get_world_size(ranks) < 2 or not checked:
            continue
        hi, lo = _spread(_digests(checked, device), ranks)
        bad = _mismatches(checked, hi, lo, rtol, atol)
        if bad:
            problems.append(what.format(count=len(bad), names=", ".join(bad)))
    if problems:
        raise RuntimeError("oases.check_gradients: " + " ".join(problems))
