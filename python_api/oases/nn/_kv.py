"""Key-value heads replicated across the ranks that share them: TP degrees above a GQA model's kv_heads.

At p <= kv_heads every rank holds kv_heads/p whole key-value heads (kv_heads % p == 0). At
p > kv_heads (p % kv_heads == 0), as inference engines do, each rank holds its heads/p query
heads and the ONE key-value head they use, c = p / kv_heads consecutive ranks holding it alike:

    rank r:  q heads [r * heads/p, (r + 1) * heads/p)       kv head  r // c        (c = p / kv_heads)
    k_proj, v_proj             ColumnParallelLinear(replicas=(c,))            weight [d, in]: kv head r // c
    fused [q | k | v]          ColumnParallelLinear(parts=(q, k, v), replicas=(1, c, c))
    attention module           kv head counts 1, num_key_value_groups heads/p (oases.nn._heads)
    backward                   each copy's weight (and bias) gradient is its query heads' share:
                               all-reduced over the c ranks holding it (copy_to_replicas), so every
                               copy gets the unsharded model's rows and the copies stay equal
    input gradient             unchanged: sum over all p ranks of (dk_r @ W_{r // c}) is the full one
    checkpoints, exports       ShardRule(replicas=...): every copy names the same boxes, written once

A fused projection is replicated this way where it is three blocks [q | k | v]: planned "column:qkv",
or laid out so by its attention class (oases.nn._heads.fused_layout: DBRX's Wqkv, multi-query
GPTBigCode's c_attn and Falcon's query_key_value, [q (heads * d) | k (d) | v (d)] with kv_heads = 1).

Refused (ValueError, before anything changes): a fused head projection other than a three-block
[q | k | v] (GPT-NeoX's query_key_value interleaves heads; GPT-2's c_attn has no GQA), Falcon's
new_decoder_architecture query_key_value (group by group: a rank would hold part of one group's
query heads), a norm over the replicated projection's whole width (OLMo-2's k_norm: its sum of
squares would count each copy), and per-layer tp_degrees.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist
import torch.nn as nn

from oases import comm as _comm
from oases.comm.topology import ring_of
from oases.nn import _heads
from oases.nn._layer_args import is_conv1d
from oases.nn.parts import HEAD_PROJECTIONS

__all__ = ["KV_PROJECTIONS", "copies", "plan_replicas", "replica_groups"]

# Head projections that compute key or value heads alone (the others compute queries, or are fused).
KV_PROJECTIONS = frozenset({"k_proj", "v_proj", "wk", "wv", "key", "value"})
_Q_PROJECTIONS = frozenset({"q_proj", "wq", "query"})


def copies(attention: nn.Module, p: int) -> int:
    """How many ranks hold each key-value head: p / kv_heads when p > kv_heads and p % kv_heads == 0
    (and heads % p == 0), else 1 (whole kv heads per rank, or counts _heads.check_heads refuses)."""
    q, kv = _heads.heads(attention)
    if q is None or kv is None or kv >= p or p % kv or q % p:
        return 1
    return p // kv


def plan_replicas(
    model: nn.Module, columns: dict[str, tuple[int, tuple[int, ...]]], degree: Callable[[str], int], per_layer: bool
) -> dict[str, tuple[int, ...]]:
    """{column head projection: its replicas} for the attention modules whose kv heads are fewer
    than their TP degree. `columns`: {name: (stacked, parts)} of the column-planned projections.

        k_proj / v_proj (plain column)            -> (c,)
        a fused [q | k | v] (parts (q, k, k))     -> (1, c, c)
        q_proj                                    -> nothing (its heads are this rank's own)
        any other head projection                 -> ValueError (its kv heads cannot be told apart)
    """
    parents: dict[str, list[str]] = {}
    for name in columns:
        parent, _, leaf = name.rpartition(".")
        if leaf in HEAD_PROJECTIONS:
            parents.setdefault(parent, []).append(name)
    found: dict[str, tuple[int, ...]] = {}
    for parent, names in parents.items():
        attention = model.get_submodule(parent)
        c = copies(attention, degree(names[0]))
        if c == 1:
            continue
        where = parent or type(model).__name__
        q, kv = _heads.heads(attention)
        if per_layer:
            raise ValueError(
                f"{where}: {kv} key-value heads at TP degree {degree(names[0])} would be replicated "
                f"over {c} ranks each, which per-layer tp_degrees do not support; use degrees <= {kv} "
                f"for its layers, or tp_degrees=None"
            )
        widths = {}
        for name in names:
            leaf = name.rpartition(".")[2]
            stacked, parts = columns[name]
            if _heads.fused_layout(attention, leaf) == "groups":
                raise ValueError(
                    f"{name}: {type(attention).__name__}'s fused {leaf} is laid out key-value group by group "
                    f"([{q // kv} query heads | k | v] for each of its {kv} key-value heads: Falcon's "
                    f"new_decoder_architecture); at TP degree {degree(name)} > {kv} key-value heads a rank would "
                    f"hold part of one group's query heads and a copy of its k and v, which oases does not shard. "
                    f"Use a TP degree that divides {kv} (each rank then holds whole groups)"
                )
            if is_conv1d(attention.get_submodule(leaf)):
                raise ValueError(
                    f"{name}: a Conv1D head projection, whose {kv} key-value heads oases does not "
                    f"replicate (TP degree {degree(name)} > kv_heads); use a TP degree that divides {kv}"
                )
            if leaf in KV_PROJECTIONS and stacked == 1 and not parts:
                found[name] = (c,)
                widths[leaf] = attention.get_submodule(leaf).out_features
            elif len(parts) == 3 and parts[1] == parts[2]:
                found[name] = (1, c, c)
            elif not (leaf in _Q_PROJECTIONS and stacked == 1 and not parts):
                raise ValueError(
                    f"{name}: {kv} key-value heads at TP degree {degree(name)} are replicated over {c} ranks each "
                    f"(p > kv_heads), and oases replicates them in k/v projections or a fused [q | k | v] "
                    f"planned 'column:qkv'; this one ({'stacked=%d' % stacked if stacked > 1 else parts or 'plain'}) "
                    f"mixes heads it cannot tell apart. Use a TP degree that divides {kv}"
                )
        norms = _heads.full_width_norms(attention, widths)
        if norms:
            child = next(iter(norms))
            raise ValueError(
                f"{where}.{child}: a norm over the whole width of {norms[child]}, whose {kv} key-value "
                f"heads are replicated over {c} ranks each at TP degree {degree(names[0])}; its sum "
                f"of squares would count every copy. Use a TP degree that divides {kv}"
            )
    return found


def replica_groups(group: Optional[dist.ProcessGroup], counts: set[int]) -> dict[int, dist.ProcessGroup]:
    """{c: this rank's group of the c consecutive ranks of `group` holding the same kv heads}.

    Collective over the world (every rank makes every group, as dist.new_group needs): every TP
    group's ranks, split into runs of c in group order; when `group` is not the world, the TP
    groups are found by an all-gather of each rank's group ranks."""
    ring = ring_of(group)
    world = dist.get_world_size()
    if ring.size == world:
        layouts = [ring.global_ranks]
    else:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, ring.global_ranks)
        layouts = sorted(set(gathered))
    me, made = dist.get_rank(), {}
    for c in sorted(counts):
        for ranks in layouts:
            for start in range(0, len(ranks), c):
                members = list(ranks[start : start + c])
                subgroup = _comm.new_group(members, high_priority=False)
                if me in members:
                    made[c] = subgroup
    return made
