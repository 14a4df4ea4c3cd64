"""Tied input/output embeddings across pipeline stages: one parameter, two copies, one gradient.

A model whose embedding and LM head share one weight W (tie_word_embeddings=True) runs the
embedding on the first stage and the head on the last. Each of the two holds a copy of W (its
vocabulary-parallel shard when TP shards it); the copies start equal (every rank builds the same
model), and stay equal because each step both take the same gradient, the single-process one:

    stage 0:    g0 = dL/dW through the embedding       (its micro-batches of this DP rank)
    stage p-1:  g1 = dL/dW through the head
    end of the step, both:  W.grad = all_reduce(W.grad, pair)      # g0 + g1 == g1 + g0, bit for bit
    then:       DP sync of W.grad alone (one bucket, the same on both: the same ring, the same bits)
    then:       each copy's optimizer step (identical gradients, states and values)

    pair = {(d, 0, t), (d, p-1, t)} of the (dp, pp, tp) mesh, one group per (d, t)

As Megatron's embedding group, but the pair sum comes before the DP sync (the DP sync sees the
full gradient of each copy, whatever it then does with it) and W has a DP bucket of its own (both
copies are summed over dp in the same order). With pp = 1 there is one copy: nothing to do here.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.pipeline.p2p import mesh_grid

__all__ = ["pair_group", "sum_copies"]


def pair_group(mesh) -> Optional[dist.ProcessGroup]:
    """This rank's group with the other copy of the tied weights: global ranks {(d, 0, t),
    (d, p-1, t)} of the mesh (None on the middle stages). Collective over the world: every rank
    makes every pair's group, (dp, tp) index-major. Needs pp > 1."""
    grid = mesh_grid(mesh)  # [dp, pp, tp] global ranks
    if grid.shape[1] < 2:
        raise ValueError(f"mesh: tied copies live on two stages; pp = {grid.shape[1]}")
    me, mine = dist.get_rank(), None
    for d in range(grid.shape[0]):
        for t in range(grid.shape[2]):
            ranks = [int(grid[d, 0, t]), int(grid[d, -1, t])]
            group = dist.new_group(ranks)
            if me in ranks:
                mine = group
    return mine


def sum_copies(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """p.grad = this copy's gradient + the other copy's, for p in params, as one flat all-reduce
    over the pair (a missing gradient counts as zeros; a parameter neither copy has a gradient for
    keeps grad None, as the DP sync does). Both copies get the same bits (a + b == b + a)."""
    if not params:
        return
    parts = [
        p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        for p in params
    ]
    flags = torch.tensor([float(p.grad is not None) for p in params], dtype=parts[0].dtype, device=parts[0].device)
    flat = torch.cat([*parts, flags])  # [numel + len(params)]
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, has in zip(params, flat[-len(params) :].tolist()):
        if has == 0:
            p.grad = None
        elif p.grad is None:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        else:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()
