"""Rank code of `oases-launch --selftest`: the bandwidth between rank 0 and rank 1, as launched.

    oases-launch --nproc 2 --bandwidth 1gbit --selftest
    oases-launch --nproc 2 --bandwidth 1gbit -m oases.launch._selftest --mib 8 --repeats 5 --json out.json

    one way     rank 0 ──MIB MiB──> rank 1 ──1 byte──> rank 0       rate = bytes / time on rank 0
    both ways   rank 0 <─MIB MiB──> rank 1 (at once), then the byte  rate = bytes / time, each way

"Both ways" tells the topologies apart: `shared` splits the rate between the two directions
(~R/2 each), `switch` gives each direction its own link (~R). Each measurement starts with one
untimed round (connections, the token bucket's initial burst) and reports the median of REPEATS
rounds. Rank 0 prints the result beside the requested rate (the launcher's OASES_BANDWIDTH)
and, with --json, writes it to a file. Other ranks only wait.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from oases.launch._rate import parse_bandwidth


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
        one_way = _seconds(rank, options.repeats, lambda: _one_way(rank, payload, flag))
        both_ways = _seconds(rank, options.repeats, lambda: _both_ways(rank, payload, inbox, flag))
        if rank == 0:
            _report(payload.numel(), one_way, both_ways, options.json)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


# Tags: a payload carries its sender's rank; the one-byte messages have their own.
_ANSWER_TAG, _READY_TAG = 2, 3


def _one_way(rank: int, payload: torch.Tensor, flag: torch.Tensor) -> None:
    if rank == 0:
        dist.send(payload, dst=1, tag=0)
        dist.recv(flag, src=1, tag=_ANSWER_TAG)  # rank 1 has it all
    else:
        dist.recv(payload, src=0, tag=0)
        dist.send(flag, dst=0, tag=_ANSWER_TAG)


def _both_ways(rank: int, payload: torch.Tensor, inbox: torch.Tensor, flag: torch.Tensor) -> None:
    # Gloo writes a payload from the sending thread only if the receive is already posted on the
    # other side; otherwise its single I/O thread writes it, taking turns with what it reads, and
    # each direction gets half the link. So: post the receive, say "ready", then send.
    peer = 1 - rank
    incoming = dist.irecv(inbox, src=peer, tag=peer)
    _flag_both_ways(rank, flag, _READY_TAG)
    outgoing = dist.isend(payload, dst=peer, tag=rank)
    outgoing.wait()
    incoming.wait()
    _flag_both_ways(rank, flag, _ANSWER_TAG)  # rank 1 has all of rank 0's payload too


def _flag_both_ways(rank: int, flag: torch.Tensor, tag: int) -> None:
    if rank == 0:
        dist.send(flag, dst=1, tag=tag)
        dist.recv(flag, src=1, tag=tag)
    else:
        dist.recv(flag, src=0, tag=tag)
        dist.send(flag, dst=0, tag=tag)


def _seconds(rank: int, repeats: int, round_trip: Callable[[], None]) -> list[float]:
    """Times of `repeats` rounds after one untimed round, on ranks 0 and 1 (others: [])."""
    if rank > 1:
        return []
    round_trip()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        round_trip()
        times.append(time.perf_counter() - start)
    return times


def _report(nbytes: int, one_way: list[float], both_ways: list[float], path: Optional[str]) -> None:
    requested = os.environ.get("OASES_BANDWIDTH")
    topology = os.environ.get("OASES_TOPOLOGY")
    result = {
        "requested": requested,
        "requested_bytes_per_s": parse_bandwidth(requested) if requested else None,
        "topology": topology,
        "payload_bytes": nbytes,
        "one_way_bytes_per_s": nbytes / statistics.median(one_way),
        "both_ways_bytes_per_s": nbytes / statistics.median(both_ways),  # each way
        "one_way_seconds": one_way,
        "both_ways_seconds": both_ways,
    }
    head = (f"requested {requested} ({result['requested_bytes_per_s'] / 1e6:.1f} MB/s)" if requested
            else "requested unshaped")
    print(f"{head}, achieved {result['one_way_bytes_per_s'] / 1e6:.1f} MB/s", flush=True)
    print(f"both ways at once: {result['both_ways_bytes_per_s'] / 1e6:.1f} MB/s each way "
          f"(topology {topology or 'none'}; {nbytes / 2**20:g} MiB, median of {len(one_way)})", flush=True)
    if path:
        with open(path, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
