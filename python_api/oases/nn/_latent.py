"""Multi-head latent attention (DeepSeek-V2/V3's MLA) as one tensor-parallel region.

MLA compresses the hidden states into low-rank latents before its per-head up-projections:

    q   = q_b_proj(q_a_layernorm(q_a_proj(x)))            (or q_proj(x) without q_lora_rank)
    c, k_rot = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim])
    k_nope, v = split(kv_b_proj(kv_a_layernorm(c)))       per head
    k   = [k_nope | k_rot]                                k_rot: one rotary key shared by every head
    out = o_proj(attention(q, k, v))

Under TP (p ranks, r this rank) the per-head up-projections (q_b_proj / q_proj, kv_b_proj) are
column-parallel by heads, o_proj row-parallel, and the low-rank down-projections, their norms and
the shared rotary key stay replicated (LATENT_PROJECTIONS: computed alike on every rank). Rank r's
heads use the latents and k_rot, so every replicated part gets only rank r's share of its
gradient, and so does x through each path: the attention is made one region, as an MoE block is
(oases.nn._moe):

    attention(x) = o_proj(attention_r(copy_to_tp(x)))    copy_to_tp: fwd identity, bwd all-reduce of
                                                          the whole input's gradient (once, all paths)
    q_b_proj, kv_b_proj, q_proj                           no entry of their own (they would all-reduce
                                                          the latents' gradient, and k_rot's would not be)
    q_a_proj, kv_a_proj_with_mqa, their norms             gradients summed over the group
                                                          (oases.nn._heads.sum_head_shared_grads)

Inside no_tp_communication (the schedules' core) o_proj neither reduces nor the region enters: the
schedule does both, and the replicated parts' gradients are partial there too, so the same sums
make them whole in both paths.
"""

from __future__ import annotations

import functools

import torch.nn as nn

from oases.nn import _moe
from oases.nn.layers import ColumnParallelLinear, RowParallelLinear
from oases.nn.parts import LATENT_PROJECTIONS

__all__ = ["is_latent", "make_latent_region"]


def is_latent(attention: nn.Module) -> bool:
    """Whether an attention module compresses its input into low-rank latents (a LATENT_PROJECTIONS child)."""
    return any(name in LATENT_PROJECTIONS for name, _ in attention.named_children())


def make_latent_region(attention: nn.Module) -> None:
    """Make a sharded MLA attention one TP region (module doc): its column layers without an entry,
    a pre-hook entering it while its row layer communicates (not in a schedule's core)."""
    rows = [m for m in attention.modules() if isinstance(m, RowParallelLinear)]
    if len(rows) != 1:
        raise ValueError(
            f"{type(attention).__name__}: multi-head latent attention with {len(rows)} row-parallel "
            f"projections; oases shards it with one (o_proj)"
        )
    for m in attention.modules():
        if isinstance(m, ColumnParallelLinear):
            m._communicate = False  # the region enters for them: its input's gradient summed once
    attention.register_forward_pre_hook(functools.partial(_moe._enter, rows[0]), with_kwargs=True)
