"""Suite `link`: what the link between the ranks carries, by message size.

For each size from 64 KiB to --max-mib (x4 steps), on the backend the run set up (gloo on the
CPU, NCCL on CUDA, NCCL over sockets with `--share-gpu`):

    all_reduce  dist.all_reduce of a float32 tensor of that size (torch's own collective)
                algbw = bytes / t;  busbw = algbw * 2 (p-1) / p  (what each rank's link carried)
    ring_p2p    every rank sends the size to rank+1 and receives it from rank-1 at once
                (batch_isend_irecv, the step of a ring): busbw = bytes / t per rank, each way

t is barrier-aligned, the per-rank median then the MAX over ranks (bench._timing). With
`--share-gpu` the ranks time-slice one GPU and NCCL runs over loopback TCP: the figures say what
that transport carries on this machine, not what a cluster's links would.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from bench._report import Table, pyplot, save_figure

KIB = 1024
MIN_BYTES = 64 * KIB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-mib", type=int, default=None, help="largest message in MiB (default 256; --quick: 1)")


def sizes(max_mib: int) -> list[int]:
    """64 KiB, 256 KiB, ... up to max_mib MiB (at least 64 KiB)."""
    out, size = [], MIN_BYTES
    while size <= max(max_mib * KIB * KIB, MIN_BYTES):
        out.append(size)
        size *= 4
    return out


def run(args, ctx) -> list[dict]:
    max_mib = args.max_mib if args.max_mib is not None else (1 if args.quick else 256)
    p = ctx.world_size
    records = []
    for size in sizes(max_mib):
        buffer = torch.ones(size // 4, dtype=torch.float32, device=ctx.device)
        incoming = torch.empty_like(buffer)

        def all_reduce():
            dist.all_reduce(buffer, group=ctx.group)

        def ring_p2p():
            if p == 1:
                incoming.copy_(buffer)
                return
            ops = [
                dist.P2POp(dist.isend, buffer, (ctx.rank + 1) % p, group=ctx.group),
                dist.P2POp(dist.irecv, incoming, (ctx.rank - 1) % p, group=ctx.group),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        timed = ctx.timer.measure({"all_reduce": all_reduce, "ring_p2p": ring_p2p})
        for op, timing in timed.items():
            factor = 2 * (p - 1) / p if op == "all_reduce" else 1.0
            records.append(
                {
                    "op": op,
                    "bytes": size,
                    "t": timing.median,
                    "t_min": timing.min,
                    "algbw_gb_s": size / timing.median / 1e9,
                    "busbw_gb_s": factor * size / timing.median / 1e9,
                    "world_size": p,
                }
            )
    return records


def _size(size: int) -> str:
    return f"{size // KIB} KiB" if size < KIB * KIB else f"{size // (KIB * KIB)} MiB"


def tables(records: list[dict]) -> list[Table]:
    if not records:
        return []
    by = {(r["op"], r["bytes"]): r for r in records}
    rows = []
    for size in sorted({r["bytes"] for r in records}):
        reduce, ring = by[("all_reduce", size)], by[("ring_p2p", size)]
        rows.append(
            [
                _size(size),
                1e3 * reduce["t"],
                reduce["algbw_gb_s"],
                reduce["busbw_gb_s"],
                1e3 * ring["t"],
                ring["busbw_gb_s"],
            ]
        )
    return [
        Table(
            f"link: {records[0]['world_size']} ranks, by message size (median, MAX over ranks)",
            ["size", "all_reduce ms", "algbw GB/s", "busbw GB/s", "ring_p2p ms", "p2p GB/s"],
            rows,
            ["busbw: all_reduce's bytes each rank's link carried, algbw * 2(p-1)/p; p2p: each way"],
        )
    ]


def plot(records: list[dict], path: str, title: str) -> bool:
    if not records:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for op in ("all_reduce", "ring_p2p"):
        points = sorted((r["bytes"], r["busbw_gb_s"]) for r in records if r["op"] == op)
        ax.plot([b / KIB for b, _ in points], [g for _, g in points], marker="o", label=f"{op} (busbw)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (KiB)")
    ax.set_ylabel("GB/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)
