"""dp_hierarchy: a Pipeline's DP sync in two-level rings (oases.comm.hierarchical: intra-host, then inter-host):
its checks, every dp group's host groups, and the "auto" choice between that and the flat ring."""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from oases.comm.hierarchical import HostGroups, HostLinks, packed_ranks_per_host, ranks_per_host_from_env
from oases.costs.collectives import partition
from oases.pipeline.dp_sync import buckets_of
from oases.pipeline.p2p import mesh_grid

__all__ = ["check_dp_hierarchy", "dp_host_groups", "hierarchy_is_faster"]


def _dp_lines(mesh) -> list[list[int]]:
    """Every dp group's global ranks, in the order make_links walks the mesh: (pp, tp) index-major."""
    grid = mesh_grid(mesh)  # [dp, pp, tp] global ranks
    return [grid[:, s, t].tolist() for s in range(grid.shape[1]) for t in range(grid.shape[2])]


def check_dp_hierarchy(dp_hierarchy: bool | str, mesh) -> Optional[int]:
    """dp_hierarchy's checks (local: every rank raises the same error). Returns how many of each
    dp group's ranks a host holds (hosts of LOCAL_WORLD_SIZE consecutive ranks, as oases-launch
    --hosts packs them), or None when the DP sync stays flat (False, or dp = 1)."""
    if not (
        dp_hierarchy is False or dp_hierarchy is True or (isinstance(dp_hierarchy, str) and dp_hierarchy == "auto")
    ):
        raise ValueError(f"dp_hierarchy: expected False, True or 'auto', got {dp_hierarchy!r}")
    lines = _dp_lines(mesh)
    if dp_hierarchy is False or len(lines[0]) == 1:
        return None
    try:
        per_host = ranks_per_host_from_env()
    except ValueError as err:
        raise ValueError(f"dp_hierarchy: {err}") from None
    counts = set()
    for ranks in lines:
        try:
            counts.add(packed_ranks_per_host(ranks, per_host))
        except ValueError as err:
            raise ValueError(f"dp_hierarchy: the dp group's {err}") from None
    if len(counts) != 1:  # (every dp group has as many ranks, on hosts of one size: cannot happen)
        raise ValueError(f"dp_hierarchy: dp groups hold {sorted(counts)} ranks per host; expected one number")
    return counts.pop()


def dp_host_groups(mesh, ranks_per_host: int) -> HostGroups:
    """This rank's HostGroups of its dp group. Collective over the world: every rank makes every
    dp group's host groups, in the mesh's order (as make_links does)."""
    mine = None
    for ranks in _dp_lines(mesh):
        groups = HostGroups.create(ranks_per_host, ranks, high_priority=False)  # DP yields to the PP links
        if groups is not None:
            mine = groups
    assert mine is not None
    return mine


def hierarchy_is_faster(
    segment_params: list[list[nn.Parameter]], bucket_numel: int, hosts: HostGroups, links: HostLinks
) -> bool:
    """dp_hierarchy="auto": oases.planner.partition's choice for the all-reduce of this stage's
    largest DP bucket (its gradients and presence flags, as SegmentSync sends it). The same on
    every rank of a dp group (same stage, same buckets, same links)."""
    sizes = [
        sum(p.numel() for p in bucket) + len(bucket)
        for params in segment_params
        for bucket in buckets_of(params, bucket_numel)
    ]
    if not sizes:
        return False
    element = next(p for params in segment_params for p in params).element_size()
    choice = partition("all_reduce", max(sizes) * element, hosts.ranks_per_host, hosts.hosts, links.intra, links.inter)
    return choice.choice == "hierarchical"
