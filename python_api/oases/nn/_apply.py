"""oases.parallelize's steps after every check has passed (oases.nn._plan_checks): the process
groups (collectives over the world, on every rank in the same order), the modules replaced by their
styles' shards, the attention modules made per-rank, the MoE regions, the per-layer degrees' hooks
and the warning about what stayed whole.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
import torch.nn as nn

from oases.degrees import LayerDegrees
from oases.nn import _alibi, _heads, _kv, _latent, _moe, _region_parameters
from oases.nn import _coverage as _summary
from oases.nn._layer_args import is_conv1d
from oases.nn._shared_entry import _SharedEntry
from oases.nn._styles import ResolvedPlan, matches

__all__ = [
    "Groups",
    "make_groups",
    "shard_modules",
    "localize_heads",
    "place_region_parameters",
    "make_moe_regions",
    "hook_degrees",
    "warn_unplaced",
]


@dataclass
class Groups:
    """The process groups the shards use, by TP degree (p: the group parallelize was given)."""

    by_degree: dict[int, Optional[dist.ProcessGroup]]  # {degree: this rank's TP group at that degree}
    entries: dict[int, _SharedEntry]  # {degree: where its column layers' input enters, shared by q, k, v}
    replica_groups: dict[int, dist.ProcessGroup]  # {c: this rank's group of the c ranks holding one kv head}
    degrees: Optional[LayerDegrees] = None  # per-layer tp_degrees: the degrees' placements and row groups


def make_groups(group: Optional[dist.ProcessGroup], rank: int, p: int, plan: ResolvedPlan) -> Groups:
    """The groups of a checked plan. Collective over the world, on every rank in this order: the
    per-layer degrees' subgroups, then the replicated kv heads' groups."""
    by_degree = {p: group}
    degrees = None
    if plan.degrees is not None:  # collective: every rank of the world makes every subgroup
        degrees = LayerDegrees.make(group or dist.group.WORLD, p, rank, plan.degrees, where=plan.prefix)
        by_degree.update((d, at.tp_group) for d, at in degrees.placements.items() if d < p)
    # q, k, v (gate, up) share one all-reduce of their input's gradient, one entry per group
    entries = {d: _SharedEntry(g) for d, g in by_degree.items()}
    counts = {c for s in plan.placed.values() for c in s.replicas if c > 1}
    replica_groups = _kv.replica_groups(group, counts) if counts else {}  # collective over the world
    return Groups(by_degree, entries, replica_groups, degrees)


def shard_modules(
    model: nn.Module, plan: ResolvedPlan, groups: Groups, p: int, *, sequence_parallel: bool, chunks: Optional[int]
) -> None:
    """Every placed module replaced by its style's shard (projections, embeddings, then experts; a
    decoder layer of degree 1 left whole), then each tied embedding and head given one shard."""
    for name, module, style in plan.sharded():  # nothing is changed before every check has passed
        d = plan.degree(name)
        if d == 1 < p:
            continue  # a decoder layer of degree 1 stays unsharded (its replica's rows, on this rank alone)
        layer = style.shard(
            module,
            groups.by_degree[d],
            entry=groups.entries[d],
            replica_groups=groups.replica_groups,
            sequence_parallel=sequence_parallel,
            chunks=chunks,
        )
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, layer)
    for embedding, head in plan.tied:  # one shard serves both ends of the tie (same rows, same rule)
        model.get_submodule(head).weight = model.get_submodule(embedding).weight


def localize_heads(plan: ResolvedPlan, groups: Groups, p: int) -> None:
    """Each attention module over sharded heads made to think in this rank's heads (oases.nn._heads):
    ALiBi biases cut, per-head parameters split, counts per rank, full-width norms sharded."""
    for name, module in plan.attention.items():
        d = plan.degree(name)
        if d == 1 < p:
            continue
        group = groups.by_degree[d]
        full_heads = _heads.heads(module)[0]
        if full_heads is not None:  # ALiBi slopes from the base model: this rank's heads' rows
            _alibi.slice_head_biases(module, full_heads, group)
        _heads.shard_head_parameters(module, group)  # GPT-OSS's sinks: this rank's heads (full counts)
        _heads.localize_heads(module, d)
        _heads.shard_norms(module, plan.norms[name], group)
        _heads.sum_head_shared_grads(module, group)  # MLA's latent projections and norms too
        if _latent.is_latent(module):
            _latent.make_latent_region(module)


def place_region_parameters(model: nn.Module, plan: ResolvedPlan, groups: Groups) -> None:
    """The dense regions' whole parameters sharded with their features or summed over the group
    (oases.nn._region_parameters), as check_plan placed them."""
    _region_parameters.apply_region_parameters(
        model, plan.region_parameters, lambda region: groups.by_degree[plan.degree(region)]
    )


def make_moe_regions(model: nn.Module, plan: ResolvedPlan, p: int) -> None:
    """Each MoE block with sharded experts one TP region: one all-reduce, router gradients summed."""
    for name in plan.placed_experts:
        if not plan.degree(name) == 1 < p:
            _moe.make_region(model, name, _summary.ROUTERS)


def hook_degrees(model: nn.Module, plan: ResolvedPlan, groups: Groups) -> None:
    """Per-layer tp_degrees: the gradients of decoder layers of degree < p summed over their replicas,
    the layers' hooks (rows resharded and cut: oases.degrees), and the degrees kept on the model as
    `model.layer_degrees` (and `model.tp_degrees`, its degrees); parallelize records them in the model's
    Parallelism too (oases.nn.parallelism), which oases.train_step reads."""
    degrees = groups.degrees
    if degrees is None:
        return
    degrees.hook_replica_sums(plan.decoder_layers)  # oases.train_step's schedules suspend them: they sum themselves
    degrees.hook_layers(plan.decoder_layers)
    model.layer_degrees = degrees
    model.tp_degrees = degrees.degrees


def warn_unplaced(model: nn.Module, plan: ResolvedPlan, p: int) -> None:
    """One warning (at parallelize's caller) naming the projections left whole, the plan patterns
    that matched nothing and the decoder layers oases.train_step runs whole; none when there are none."""
    unplaced = [name for name in plan.linears if name not in plan.placed and name not in plan.routers]
    unused = [
        pattern
        for pattern, s in plan.styles.items()
        if plan.explicit
        and pattern not in plan.inherited
        and s.kind != "vocab"
        and not any(matches(n, pattern) for n in (plan.experts if s.kind == "experts" else plan.linears))
    ]
    unused_vocab = [
        pattern
        for pattern, s in plan.styles.items()
        if s.kind == "vocab" and not any(matches(n, pattern) for n in plan.embeddings)
    ]
    whole = _summary.whole_layers(model) if p > 1 else ""
    if not (unplaced or unused or unused_vocab or whole):
        return
    message = "oases.parallelize:" + whole
    if unplaced:
        kind = "nn.Linear / Conv1D" if any(is_conv1d(plan.linears[n]) for n in unplaced) else "nn.Linear"
        message += (
            f" left {len(unplaced)} {kind} module(s) unsharded (replicated on every rank; "
            f"no plan pattern matches them): {', '.join(unplaced)}." + _summary.report(model, unplaced)
        )
    if unused:
        message += f" Plan patterns matching no nn.Linear: {', '.join(map(repr, unused))}."
    if unused_vocab:
        message += f" Plan patterns matching no nn.Embedding: {', '.join(map(repr, unused_vocab))}."
    warnings.warn(message, UserWarning, stacklevel=3)  # warn_unplaced <- parallelize <- its caller
