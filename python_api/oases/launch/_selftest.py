"""Rank code of `oases-launch --selftest`: the bandwidth between rank 0 and rank 1, as launched.

    oases-launch --nproc 2 --bandwidth 1gbit --selftest
    oases-launch --nproc 4 --hosts 2 --bandwidth 1gbit --selftest     # inside and across hosts
    oases-launch --nproc 2 --bandwidth 1gbit -m oases.launch._selftest --mib 8 --repeats 5 --json out.json

    one way     rank 0 ──MIB MiB──> rank 1 ──1 byte──> rank 0       rate = bytes / time on rank 0
    both ways   rank 0 <─MIB MiB──> rank 1 (at once), then the byte  rate = bytes / time, each way

"Both ways" tells the topologies apart: `shared` splits the rate between the two directions
(~R/2 each), `switch` gives each direction its own link (~R). Each measurement starts with one
untimed round (connections, the token bucket's initial burst) and reports the median of REPEATS
rounds. Rank 0 prints the result beside the requested rate (the launcher's OASES_BANDWIDTH)
and, with --json, writes it to a file. Other ranks only wait.

On several hosts (LOCAL_WORLD_SIZE < WORLD_SIZE, as torchrun sets them on several nodes) it
measures two pairs, one after the other: inside host 0 (rank 0 <-> rank 1, requested:
OASES_INTRA_BANDWIDTH, else unshaped) and across hosts (rank 0 <-> rank LOCAL_WORLD_SIZE, the
first of host 1; requested: OASES_BANDWIDTH). The JSON then holds one record per pair,
"intra_host" and "inter_host", each with the keys a one-host result has at its top level.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from oases.costs.rate import parse_bandwidth


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Measure on the ranks of the current torchrun-style environment; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m oases.launch._selftest")
    parser.add_argument("--mib", type=int, default=32, help="payload per transfer, MiB (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per measurement (default 3)")
    parser.add_argument("--json", metavar="PATH", help="rank 0 also writes the result here")
    options = parser.parse_args(argv)
    if options.mib < 1 or options.repeats < 1:
        parser.error("--mib and --repeats must be >= 1")

    dist.init_process_group("gloo")
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if world_size < 2:
            print("selftest: needs at least 2 ranks", file=sys.stderr)
            return 2
        payload = torch.ones(options.mib * 2**20, dtype=torch.uint8)
        inbox, flag = torch.empty_like(payload), torch.zeros(1, dtype=torch.uint8)
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        links = _links(world_size, local_world_size)
        measured = {}
        for link in links:  # one pair at a time; the other ranks skip it
            one_way = _seconds(rank, link, options.repeats, functools.partial(_one_way, rank, link, payload, flag))
            both_ways = _seconds(
                rank, link, options.repeats, functools.partial(_both_ways, rank, link, payload, inbox, flag)
            )
            measured[link] = (one_way, both_ways)
        if rank == 0:
            _report(payload.numel(), measured, world_size // local_world_size, options.json)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


@dataclass(frozen=True)
class _Link:
    """A pair of ranks to measure, and what was asked of the link between them."""

    kind: Optional[str]  # "intra_host" / "inter_host"; None: the ranks are on one host
    ranks: tuple[int, int]  # (first, second); rank 0 is always first
    requested: Optional[str]  # tc rate; None: unshaped


def _links(world_size: int, local_world_size: int) -> list[_Link]:
    """One host: rank 0 <-> rank 1. Several hosts: that pair inside host 0, then rank 0 <-> the
    first rank of host 1 across hosts."""
    inter = os.environ.get("OASES_BANDWIDTH")
    if local_world_size >= world_size:
        return [_Link(None, (0, 1), inter)]
    intra = os.environ.get("OASES_INTRA_BANDWIDTH") if inter else None
    links = [_Link("intra_host", (0, 1), intra)] if local_world_size >= 2 else []
    return [*links, _Link("inter_host", (0, local_world_size), inter)]


# Tags: a payload carries its sender's index in the pair (0 or 1); the one-byte messages have their own.
_ANSWER_TAG, _READY_TAG = 2, 3


def _one_way(rank: int, link: _Link, payload: torch.Tensor, flag: torch.Tensor) -> None:
    first, second = link.ranks
    if rank == first:
        dist.send(payload, dst=second, tag=0)
        dist.recv(flag, src=second, tag=_ANSWER_TAG)  # the second rank has it all
    else:
        dist.recv(payload, src=first, tag=0)
        dist.send(flag, dst=first, tag=_ANSWER_TAG)


def _both_ways(rank: int, link: _Link, payload: torch.Tensor, inbox: torch.Tensor, flag: torch.Tensor) -> None:
    # Gloo writes a payload from the sending thread only if the receive is already posted on the
    # other side; otherwise its single I/O thread writes it, taking turns with what it reads, and
    # each direction gets half the link. So: post the receive, say "ready", then send.
    me = link.ranks.index(rank)
    peer = link.ranks[1 - me]
    incoming = dist.irecv(inbox, src=peer, tag=1 - me)
    _flag_both_ways(rank, link, flag, _READY_TAG)
    outgoing = dist.isend(payload, dst=peer, tag=me)
    outgoing.wait()
    incoming.wait()
    _flag_both_ways(rank, link, flag, _ANSWER_TAG)  # the second rank has all of the first's payload too


def _flag_both_ways(rank: int, link: _Link, flag: torch.Tensor, tag: int) -> None:
    first, second = link.ranks
    if rank == first:
        dist.send(flag, dst=second, tag=tag)
        dist.recv(flag, src=second, tag=tag)
    else:
        dist.recv(flag, src=first, tag=tag)
        dist.send(flag, dst=first, tag=tag)


def _seconds(rank: int, link: _Link, repeats: int, round_trip: Callable[[], None]) -> list[float]:
    """Times of `repeats` rounds after one untimed round, on the link's two ranks (others: [])."""
    if rank not in link.ranks:
        return []
    round_trip()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        round_trip()
        times.append(time.perf_counter() - start)
    return times


def _report(
    nbytes: int, measured: dict[_Link, tuple[list[float], list[float]]], hosts: int, path: Optional[str]
) -> None:
    topology = os.environ.get("OASES_TOPOLOGY")
    records = {link: _record(link, nbytes, *times) for link, times in measured.items()}
    repeats = len(next(iter(measured.values()))[0])
    footer = f"{nbytes / 2**20:g} MiB, median of {repeats}"
    if [link.kind for link in records] == [None]:
        (record,) = records.values()
        result: dict[str, Any] = {"topology": topology, "payload_bytes": nbytes, **record}
        del result["ranks"]
        print(f"{_requested(record)}, achieved {record['one_way_bytes_per_s'] / 1e6:.1f} MB/s", flush=True)
        print(
            f"both ways at once: {record['both_ways_bytes_per_s'] / 1e6:.1f} MB/s each way "
            f"(topology {topology or 'none'}; {footer})",
            flush=True,
        )
    else:
        result = {
            "topology": topology,
            "hosts": hosts,
            "payload_bytes": nbytes,
            **{link.kind: record for link, record in records.items()},
        }
        for link, record in records.items():
            first, second = link.ranks
            print(
                f"{link.kind.replace('_', '-')}, rank {first} <-> rank {second}: {_requested(record)}, "
                f"achieved {record['one_way_bytes_per_s'] / 1e6:.1f} MB/s; both ways at once "
                f"{record['both_ways_bytes_per_s'] / 1e6:.1f} MB/s each way",
                flush=True,
            )
        print(f"(topology {topology or 'none'}, {hosts} hosts; {footer})", flush=True)
    if path:
        with open(path, "w") as out:
            json.dump(result, out, indent=1)


def _record(link: _Link, nbytes: int, one_way: list[float], both_ways: list[float]) -> dict[str, Any]:
    return {
        "ranks": list(link.ranks),
        "requested": link.requested,
        "requested_bytes_per_s": parse_bandwidth(link.requested) if link.requested else None,
        "one_way_bytes_per_s": nbytes / statistics.median(one_way),
        "both_ways_bytes_per_s": nbytes / statistics.median(both_ways),  # each way
        "one_way_seconds": one_way,
        "both_ways_seconds": both_ways,
    }


def _requested(record: dict[str, Any]) -> str:
    if record["requested"] is None:
        return "requested unshaped"
    return f"requested {record['requested']} ({record['requested_bytes_per_s'] / 1e6:.1f} MB/s)"


if __name__ == "__main__":
    raise SystemExit(main())
