"""`oases env --probe-link` (oases.env's module doc): a ping-pong between ranks 0 and 1 and an
all-gather on all ranks over gloo, each fitted to latency + bytes / rate, and rank 0's text."""

from __future__ import annotations

import datetime
import os
import statistics
import time
from typing import Any, Callable, Mapping, Optional, Sequence

DEFAULT_SIZES = "64KiB,256KiB,1MiB,4MiB,16MiB"


class OutsideLaunch(RuntimeError):
    """--probe-link was run without a launch's environment."""


def _usage_outside() -> str:
    return (
        "oases env --probe-link: not inside a launch (RANK and WORLD_SIZE are not set).\n"
        "It measures the link between ranks 0 and 1 of a launch; run it on 2 or more ranks:\n"
        "    oases-launch --nproc 2 -m oases.env --probe-link                    # this machine's loopback\n"
        "    oases-launch --nproc 2 --bandwidth 1gbit -m oases.env --probe-link  # the emulator's shaped link\n"
        "    torchrun --nnodes 2 --nproc-per-node 1 ... -m oases.env --probe-link  # two servers"
    )


def format_link(bytes_per_s: float) -> str:
    """A rate in the syntax of `oases plan --link` and tc, to 3 significant digits: 24.8e6 -> "198mbit"."""
    bits = float(bytes_per_s) * 8
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            number = f"{bits / scale:.3g}"
            if "e" in number:  # >= 1000 tbit: no larger unit
                number = f"{bits / scale:.0f}"
            return f"{number}{unit}"
    return f"{max(round(bits), 8)}bit"


def _parse_sizes(text: str) -> list[int]:
    from oases.planner.profile import parse_bytes

    sizes = sorted({parse_bytes(part, what="--sizes") for part in text.split(",") if part.strip()})
    if len(sizes) < 2:
        raise ValueError(f"--sizes: give 2 or more sizes (the rate is the slope between the largest two), got {text!r}")
    return sizes


def _fit(samples: Sequence[tuple[int, float]]) -> dict[str, Any]:
    from oases.costs.link import LinkFit

    fit = LinkFit.from_samples(samples)
    return {
        "samples": [[int(n), float(t)] for n, t in samples],
        "latency_s": fit.latency_s,
        "bytes_per_s": fit.bytes_per_s,
    }


def summarize_probe(
    p2p: Sequence[tuple[int, float]], all_gather: Sequence[tuple[int, float]], world_size: int, repeats: int
) -> dict[str, Any]:
    """The probe's result from its samples ((bytes, seconds): p2p one message; all-gather the gathered tensor)."""
    result: dict[str, Any] = {
        "world_size": world_size,
        "repeats": repeats,
        "requested": os.environ.get("OASES_BANDWIDTH"),
        "topology": os.environ.get("OASES_TOPOLOGY"),
        "p2p": _fit(p2p),
        "all_gather": _fit(all_gather),
    }
    ag, p = result["all_gather"], world_size
    # The planner's ring all-gather: (p-1) a + (p-1)/p n / B; the link that gives the measured fit.
    ag["ring_link_bytes_per_s"] = ag["bytes_per_s"] * (p - 1) / p
    ag["ring_latency_s"] = ag["latency_s"] / (p - 1)
    result["link"] = format_link(result["p2p"]["bytes_per_s"])
    result["latency_s"] = result["p2p"]["latency_s"]
    return result


def _size_text(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def render_probe(result: Mapping[str, Any]) -> str:
    """Rank 0's text: both sweeps with their fits, then the --link line."""
    from oases.planner.profile import parse_link

    requested = result.get("requested")
    shaped = (
        (
            f"the launcher's link: {requested} ({parse_link(requested) / 1e6:.1f} MB/s), topology "
            f"{result.get('topology') or '?'}"
        )
        if requested
        else "no OASES_BANDWIDTH (unshaped or not oases-launch)"
    )
    lines = [f"oases env --probe-link: {result['world_size']} ranks over gloo; {shaped}"]
    sweeps = (
        ("p2p", "p2p, rank 0 <-> rank 1: half a ping-pong"),
        ("all_gather", f"all-gather, {result['world_size']} ranks: size = the gathered tensor, slowest rank"),
    )
    for key, title in sweeps:
        sweep = result[key]
        lines += ["", f"{title} (median of {result['repeats']}+ rounds)", f"  {'size':>9}  {'ms':>9}  {'MB/s':>9}"]
        lines += [
            f"  {_size_text(n):>9}  {1e3 * t:9.3f}  {n / t / 1e6 if t > 0 else float('inf'):9.1f}"
            for n, t in sweep["samples"]
        ]
        lines.append(f"  fit: {1e3 * sweep['latency_s']:.3f} ms + bytes / {sweep['bytes_per_s'] / 1e6:.1f} MB/s")
    ag = result["all_gather"]
    lines.append(
        f"  as the planner's ring all-gather: a {format_link(ag['ring_link_bytes_per_s'])} link "
        f"({ag['ring_link_bytes_per_s'] / 1e6:.1f} MB/s), {1e3 * ag['ring_latency_s']:.3f} ms per step"
        + (
            " (concurrent transfers share the link)"
            if ag["ring_link_bytes_per_s"] < 0.75 * result["p2p"]["bytes_per_s"]
            else ""
        )
    )
    lines += [
        "",
        f"link: {result['link']}   latency: {1e3 * result['latency_s']:.3f} ms per message "
        f"({result['p2p']['bytes_per_s'] / 1e6:.1f} MB/s)",
        f"  oases plan --model MODEL --world N --device-memory MEM --link {result['link']}",
    ]
    return "\n".join(lines)


def probe_link(sizes: Sequence[int], repeats: int, timeout_s: float) -> Optional[dict[str, Any]]:
    """Measure on the ranks of the current launch (see the module docstring); the result on rank 0,
    None on the others. OutsideLaunch without RANK / WORLD_SIZE; ValueError for other usage errors."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise OutsideLaunch(_usage_outside())
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ValueError(f"{' and '.join(missing)} not set: start the ranks with oases-launch or torchrun")
    if int(os.environ["WORLD_SIZE"]) < 2:
        raise ValueError("needs 2 or more ranks (e.g. oases-launch --nproc 2 -m oases.env --probe-link)")
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        buffer = torch.zeros(max(sizes), dtype=torch.uint8)
        p2p = (
            [(n, _median_time(lambda: _ping_pong(rank, buffer[:n]), _rounds(n, repeats)) / 2) for n in sizes]
            if rank in (0, 1)
            else [(n, 0.0) for n in sizes]
        )
        # all_gather_single: newer torch's name for all_gather_into_tensor (which then warns it is deprecated)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gathered = []
        for n in sizes:
            chunk = max(n // world, 1)
            out, mine = torch.empty(chunk * world, dtype=torch.uint8), torch.zeros(chunk, dtype=torch.uint8)
            gathered.append(
                (chunk * world, _median_time(lambda: all_gather(out, mine), _rounds(n, repeats), sync=dist.barrier))
            )
        slowest = torch.tensor([t for _, t in gathered], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        ag_samples = [(n, float(t)) for (n, _), t in zip(gathered, slowest.tolist())]
        result = summarize_probe(p2p, ag_samples, world, repeats) if rank == 0 else None
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def _ping_pong(rank: int, message: Any) -> None:
    import torch.distributed as dist

    if rank == 0:
        dist.send(message, dst=1)
        dist.recv(message, src=1)
    else:
        dist.recv(message, src=0)
        dist.send(message, dst=0)


def _rounds(nbytes: int, repeats: int) -> int:
    """Timed rounds for one size: `repeats`, more below 1 MiB (up to 16x). A function of the size
    alone, so every rank runs the same number of rounds."""
    return max(repeats, min(16 * repeats, -(-repeats * 2**20 // nbytes)))


def _median_time(operation: Callable[[], None], repeats: int, sync: Optional[Callable[[], Any]] = None) -> float:
    """Median seconds of `repeats` runs after one untimed run (connections, a token bucket's burst)."""
    operation()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = time.perf_counter()
        operation()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
