"""Two-level (inter-/intra-host) all-gather, reduce-scatter and all-reduce, and the planned forms
that pick flat or hierarchical by Centauri's partition choice (oases.costs.collectives).

A group of P = h k ranks, packed into h hosts of k (group rank g = host * k + local), has one
intra-host group per host (its k ranks, ranked by local index) and one inter-host group per local
index (the h ranks with that index, ranked by host): `HostGroups`. Every result has exactly the
layout of the flat ring of oases.comm (`ring_all_gather` / `ring_reduce_scatter` / `all_reduce`).

    hierarchical_reduce_scatter(t [P n, ...]) -> [n, ...]        (dim 0 shown; any dim)
        blocks = t.view(h, k, n, ...)                  # block (H, l) belongs to rank H k + l
        x = blocks.transpose(0, 1)                     # [k, h, n, ...]: local index major
        x = ring_reduce_scatter(x, intra)              # [h, n, ...]: blocks (*, l) summed over my host
        out = ring_reduce_scatter(x, inter)            # [n, ...]: block (H, l) summed over hosts

    hierarchical_all_gather(t [n, ...]) -> [P n, ...]            (the reverse: its adjoint)
        x = ring_all_gather(t, inter)                  # [h, n, ...]: blocks (*, l)
        x = ring_all_gather(x, intra)                  # [k, h, n, ...]
        out = x.transpose(0, 1).reshape(P n, ...)      # block (H, l) at rows (H k + l) n

    hierarchical_all_reduce(t) = hierarchical RS, then hierarchical AG, of flat(t) padded to P.

`hierarchical_reduce_scatter_steps` / `hierarchical_all_gather_steps` are the same two levels as
generators (the flat `*_steps` of oases.comm.ring composed with `yield from`): they yield between
ring steps, so a caller (oases.pipeline's gated DP thread) runs or holds back each step.

Bytes each rank sends, for a full tensor of T bytes (RS input, AG output), m = T / P:

    flat ring:      (P-1) m = (P-1)/P T, of which the last rank of each host sends it all over
                    the NIC: (P-1)/P T per host NIC, each way
    hierarchical:   intra (k-1)/k T over the host's link, then inter (h-1)/h T / k over the NIC;
                    the k ranks of a host share the NIC: (h-1)/h T per host NIC, each way

(h = 2, k = 2: 3/4 T against 1/2 T through each NIC.) oases.costs.collectives models the times.

Summation order: the flat ring sums block g as ((x[g+1] + x[g+2]) + ...) + x[g] round the ring of
P ranks; the hierarchical form sums each host's ranks in its ring order, then the host partials
in the inter ring's order. Floating-point sums may then differ in the last bits (exactly equal
when every partial sum is exact, e.g. integer-valued floats); the gathers only copy, so
all-gather is bit-for-bit the flat one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Generator, Optional, Sequence

import torch
import torch.distributed as dist

from oases import _checks
from oases.comm.groups import new_group
from oases.comm.ring import (
    _drain,
    _to_rows,
    all_gather_steps,
    all_reduce,
    reduce_scatter_steps,
    ring_all_gather,
    ring_reduce_scatter,
)
from oases.comm.topology import ring_of
from oases.costs.collectives import partition
from oases.costs.link import DEFAULT_LATENCY_S, LinkFit
from oases.costs.rate import parse_bandwidth

__all__ = [
    "HostGroups",
    "HostLinks",
    "hierarchical_all_gather",
    "hierarchical_reduce_scatter",
    "hierarchical_all_reduce",
    "planned_all_gather",
    "planned_reduce_scatter",
    "planned_all_reduce",
    "planned_form",
    "ranks_per_host_from_env",
    "UNSHAPED_BYTES_PER_S",
    "hierarchical_reduce_scatter_steps",
    "hierarchical_all_gather_steps",
    "packed_ranks_per_host",
]

# The rate assumed for an unshaped link (a host's loopback, or hosts nobody shaped): about what
# `oases-launch --selftest` measures on this project's 2-core machine, both ways at once (1.7 GB/s).
UNSHAPED_BYTES_PER_S = 1.7e9


@dataclass(frozen=True)
class HostGroups:
    """A process group split into `hosts` hosts of `ranks_per_host` ranks, and this rank's two
    sub-groups. Build it with `create` or `from_env` (collective over the world)."""

    group: Optional[dist.ProcessGroup]  # all P = hosts * ranks_per_host ranks (None: the world)
    intra: dist.ProcessGroup  # this rank's host: its k ranks, by local index
    inter: dist.ProcessGroup  # the h ranks with this rank's local index, by host
    ranks_per_host: int
    hosts: int
    host: int  # this rank's host, 0..hosts-1
    local: int  # this rank's index within its host, 0..ranks_per_host-1

    @property
    def size(self) -> int:
        """P = hosts * ranks_per_host, the ranks of `group`."""
        return self.hosts * self.ranks_per_host

    @classmethod
    def create(
        cls, ranks_per_host: int, ranks: Optional[Sequence[int]] = None, *, high_priority: bool = True
    ) -> Optional["HostGroups"]:
        """Split `ranks` (global ranks, default the whole world; sorted) into hosts of
        `ranks_per_host` consecutive ranks. Collective: every rank of the world calls it with the
        same arguments (it makes h + k groups, one more for a subset, with dist.new_group, in the
        same order everywhere);
        ranks outside `ranks` get None. `high_priority`: the groups' NCCL streams (as
        oases.comm.new_group; False for traffic that must yield, e.g. a pipeline's DP sync)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group() first")
        world = dist.get_world_size()
        members = sorted(range(world) if ranks is None else (int(r) for r in ranks))
        if len(set(members)) != len(members) or not members or not all(0 <= r < world for r in members):
            raise ValueError(f"ranks: expected distinct global ranks in [0, {world}), got {ranks!r}")
        if not _checks.is_int(ranks_per_host) or ranks_per_host < 1:
            raise ValueError(f"ranks_per_host: expected an int >= 1, got {ranks_per_host!r}")
        if len(members) % ranks_per_host:
            raise ValueError(f"ranks_per_host: {len(members)} ranks do not split into hosts of {ranks_per_host}")
        k, h = ranks_per_host, len(members) // ranks_per_host
        group = None if len(members) == world else new_group(members, high_priority=high_priority)
        intra_groups = [new_group(members[H * k : (H + 1) * k], high_priority=high_priority) for H in range(h)]
        inter_groups = [new_group(members[l::k], high_priority=high_priority) for l in range(k)]
        me = dist.get_rank()
        if me not in members:
            return None
        g = members.index(me)
        return cls(group, intra_groups[g // k], inter_groups[g % k], k, h, g // k, g % k)

    @classmethod
    def from_env(cls) -> "HostGroups":
        """The world split as the launcher placed it: LOCAL_WORLD_SIZE ranks per host
        (oases-launch --hosts H, torchrun on H nodes). Collective, like `create`."""
        groups = cls.create(ranks_per_host_from_env())
        assert groups is not None  # the whole world
        return groups


@dataclass(frozen=True)
class HostLinks:
    """The two links of the host model (oases.costs.collectives): a host's internal link and
    its NIC. Must be the same on every rank, so every rank plans the same collective."""

    intra: LinkFit
    inter: LinkFit

    @classmethod
    def from_env(cls, latency_s: float = DEFAULT_LATENCY_S) -> "HostLinks":
        """The links oases-launch shaped: OASES_BANDWIDTH between hosts, OASES_INTRA_BANDWIDTH
        inside one; an unset (unshaped) link runs at UNSHAPED_BYTES_PER_S."""

        def rate(name: str) -> float:
            text = os.environ.get(name)
            if not text:
                return UNSHAPED_BYTES_PER_S
            try:
                return parse_bandwidth(text)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None

        return cls(LinkFit(latency_s, rate("OASES_INTRA_BANDWIDTH")), LinkFit(latency_s, rate("OASES_BANDWIDTH")))


def _check_member(hosts: HostGroups) -> None:
    if not isinstance(hosts, HostGroups):
        raise TypeError(f"hosts: expected a HostGroups, got {type(hosts).__name__}")
    ring = ring_of(hosts.group)
    if ring.size != hosts.size:
        raise ValueError(f"hosts: its group has {ring.size} ranks, not hosts * ranks_per_host = {hosts.size}")


def hierarchical_reduce_scatter(
    t: torch.Tensor, hosts: HostGroups, *, dim: int = 0, chunks: int = 1, bidirectional: bool = False
) -> torch.Tensor:
    """ring_reduce_scatter(t, hosts.group, dim=dim) in two levels (see the module docstring).
    Dual: hierarchical_all_gather.

    ::

        n = t.shape[dim] // P
        out = sum(t from every rank).narrow(dim, rank * n, n)          # to summation order

    t.shape[dim] must divide by P * chunks."""
    with torch.profiler.record_function("oases::hierarchical_reduce_scatter"):
        return _drain(hierarchical_reduce_scatter_steps(t, hosts, dim=dim, chunks=chunks, bidirectional=bidirectional))


def hierarchical_all_gather(
    t: torch.Tensor, hosts: HostGroups, *, dim: int = 0, chunks: int = 1, bidirectional: bool = False
) -> torch.Tensor:
    """ring_all_gather(t, hosts.group, dim=dim) in two levels, bit-for-bit the same result.
    Dual: hierarchical_reduce_scatter.

    ::

        out = cat([t from rank 0, ..., t from rank P-1], dim)

    `chunks` must divide t.shape[dim]."""
    with torch.profiler.record_function("oases::hierarchical_all_gather"):
        return _drain(hierarchical_all_gather_steps(t, hosts, dim=dim, chunks=chunks, bidirectional=bidirectional))


def hierarchical_all_reduce(
    t: torch.Tensor, hosts: HostGroups, *, chunks: int = 1, bidirectional: bool = False
) -> torch.Tensor:
    """oases.comm.all_reduce(t, hosts.group) as hierarchical RS + AG: sums `t` over ranks in
    place and returns it (any shape: padded to a multiple of P * chunks internally)."""
    _check_member(hosts)
    _checks.floating("t", t)
    _checks.chunks_arg(chunks)
    quantum = hosts.size * chunks
    flat = t.new_zeros(-(-t.numel() // quantum) * quantum)  # [P n]
    flat[: t.numel()].copy_(t.reshape(-1))
    with torch.profiler.record_function("oases::hierarchical_all_reduce"):
        own = hierarchical_reduce_scatter(flat, hosts, chunks=chunks, bidirectional=bidirectional)
        flat = hierarchical_all_gather(own, hosts, chunks=chunks, bidirectional=bidirectional)
    t.copy_(flat[: t.numel()].view(t.shape))
    return t


def _choice(kind: str, t: torch.Tensor, hosts: HostGroups, links: HostLinks, full: bool) -> str:
    if not isinstance(links, HostLinks):
        raise TypeError(f"links: expected a HostLinks, got {type(links).__name__}")
    nbytes = t.numel() * t.element_size() * (1 if full else hosts.size)
    return partition(kind, nbytes, hosts.ranks_per_host, hosts.hosts, links.intra, links.inter).choice


def planned_reduce_scatter(
    t: torch.Tensor, hosts: HostGroups, links: HostLinks, *, dim: int = 0, chunks: int = 1
) -> torch.Tensor:
    """Reduce-scatter by the form oases.costs.collectives.partition picks for this size and these links:
    ring_reduce_scatter on hosts.group ("flat") or hierarchical_reduce_scatter. Every rank picks
    the same form (same shape, same links). The trace shows `oases::planned[...]`."""
    _check_member(hosts)
    _checks.floating("t", t)
    form = _choice("reduce_scatter", t, hosts, links, full=True)
    with torch.profiler.record_function(f"oases::planned[reduce_scatter:{form}]"):
        if form == "hierarchical":
            return hierarchical_reduce_scatter(t, hosts, dim=dim, chunks=chunks)
        return ring_reduce_scatter(t, hosts.group, dim=dim, chunks=chunks)


def planned_all_gather(
    t: torch.Tensor, hosts: HostGroups, links: HostLinks, *, dim: int = 0, chunks: int = 1
) -> torch.Tensor:
    """All-gather by the planned form (see planned_reduce_scatter); the result is the same either way."""
    _check_member(hosts)
    _checks.floating("t", t)
    form = _choice("all_gather", t, hosts, links, full=False)
    with torch.profiler.record_function(f"oases::planned[all_gather:{form}]"):
        if form == "hierarchical":
            return hierarchical_all_gather(t, hosts, dim=dim, chunks=chunks)
        return ring_all_gather(t, hosts.group, dim=dim, chunks=chunks)


def planned_all_reduce(t: torch.Tensor, hosts: HostGroups, links: HostLinks, *, chunks: int = 1) -> torch.Tensor:
    """In-place all-reduce (RS + AG rings) by the planned form (see planned_reduce_scatter)."""
    _check_member(hosts)
    _checks.floating("t", t)
    form = _choice("all_reduce", t, hosts, links, full=True)
    with torch.profiler.record_function(f"oases::planned[all_reduce:{form}]"):
        if form == "hierarchical":
            return hierarchical_all_reduce(t, hosts, chunks=chunks)
        return all_reduce(t, hosts.group, chunks=chunks)


def planned_form(kind: str, t: torch.Tensor, hosts: HostGroups, links: HostLinks) -> str:
    """The form ("flat" | "hierarchical") planned_<kind> would run for `t` (local: no communication)."""
    return _choice(kind, t, hosts, links, full=kind != "all_gather")


# --- step generators (for callers that interleave other work, e.g. a gated DP thread) ----------


def hierarchical_reduce_scatter_steps(
    t: torch.Tensor, hosts: HostGroups, *, dim: int = 0, chunks: int = 1, bidirectional: bool = False, tag: int = 0
) -> Generator[None, None, torch.Tensor]:
    """hierarchical_reduce_scatter, one ring step at a time, as oases.comm.reduce_scatter_steps:
    yields after each ring step of the intra ring, then of the inter ring, and returns the result
    (`out = yield from hierarchical_reduce_scatter_steps(t, hosts)`), bit-for-bit that of
    hierarchical_reduce_scatter. Arguments are checked at the call, before the first step; `tag`
    as in all_gather_steps (used on both sub-groups)."""
    _check_member(hosts)
    _checks.floating("t", t)
    _checks.chunks_arg(chunks)
    dim = _checks.normalize_dim("t", t, dim)
    _checks.full_divisible("t.shape[dim]", t.shape[dim], hosts.size, chunks)

    def steps() -> Generator[None, None, torch.Tensor]:
        h, k = hosts.hosts, hosts.ranks_per_host
        rows = _to_rows(t, dim)  # [P n, ...]
        n, rest = rows.shape[0] // hosts.size, rows.shape[1:]
        x = rows.view(h, k, n, *rest).transpose(0, 1).reshape(k * h * n, *rest)  # [k h n, ...]
        for group in (hosts.intra, hosts.inter):  # [k h n] -> [h n] -> [n]
            with torch.profiler.record_function("oases::ring_reduce_scatter"):
                x = yield from reduce_scatter_steps(x, group, chunks=chunks, bidirectional=bidirectional, tag=tag)
        out = x
        return out.movedim(0, dim).contiguous()

    return steps()


def hierarchical_all_gather_steps(
    t: torch.Tensor, hosts: HostGroups, *, dim: int = 0, chunks: int = 1, bidirectional: bool = False, tag: int = 0
) -> Generator[None, None, torch.Tensor]:
    """hierarchical_all_gather, one ring step at a time (inter ring, then intra ring), as
    oases.comm.all_gather_steps; returns the result, bit-for-bit the flat ring's. Dual:
    hierarchical_reduce_scatter_steps."""
    _check_member(hosts)
    _checks.floating("t", t)
    _checks.chunks_arg(chunks)
    dim = _checks.normalize_dim("t", t, dim)
    _checks.divisible("t.shape[dim]", t.shape[dim], hosts.size, chunks)

    def steps() -> Generator[None, None, torch.Tensor]:
        h, k = hosts.hosts, hosts.ranks_per_host
        shard = _to_rows(t, dim)  # [n, ...]
        n, rest = shard.shape[0], shard.shape[1:]
        x = shard
        for group in (hosts.inter, hosts.intra):  # [n] -> [h n] -> [k h n]
            with torch.profiler.record_function("oases::ring_all_gather"):
                x = yield from all_gather_steps(x, group, chunks=chunks, bidirectional=bidirectional, tag=tag)
        out = x.view(k, h, n, *rest).transpose(0, 1).reshape(h * k * n, *rest)  # [P n, ...]
        return out.movedim(0, dim).contiguous()

    return steps()


def ranks_per_host_from_env() -> int:
    """LOCAL_WORLD_SIZE, the ranks per host oases-launch --hosts H (or torchrun) placed; ValueError
    naming it when unset or not an int >= 1. Local (the same on every rank the launcher started)."""
    text = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        k = int(text) if text is not None else 0
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(
            f"LOCAL_WORLD_SIZE: expected the ranks per host, an int >= 1 (set by oases-launch --hosts H "
            f"or torchrun; or call HostGroups.create(ranks_per_host)), got {text!r}"
        )
    return k


def packed_ranks_per_host(ranks: Sequence[int], ranks_per_host: int) -> int:
    """How many of the global `ranks` each host holds, with hosts of `ranks_per_host` consecutive
    global ranks (host of rank r = r // ranks_per_host, as oases-launch --hosts packs them): the
    `ranks_per_host` to give HostGroups.create(..., ranks=ranks). Local (no communication).
    ValueError unless every host holding any of `ranks` holds the same number of them."""
    if not _checks.is_int(ranks_per_host) or ranks_per_host < 1:
        raise ValueError(f"ranks_per_host: expected an int >= 1, got {ranks_per_host!r}")
    per_host: dict[int, int] = {}
    for r in ranks:
        per_host[int(r) // ranks_per_host] = per_host.get(int(r) // ranks_per_host, 0) + 1
    counts = set(per_host.values())
    if len(counts) != 1:
        layout = ", ".join(f"host {host}: {count}" for host, count in sorted(per_host.items()))
        raise ValueError(
            f"ranks {sorted(int(r) for r in ranks)} are not packed evenly into hosts of "
            f"{ranks_per_host} ranks ({layout}): every host must hold the same number of them"
        )
    return counts.pop()
