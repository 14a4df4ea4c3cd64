"""`python -m bench checkpoint`: what a checkpoint's integrity and durability cost on this disk.

    python -m bench checkpoint                        # 2 ranks, HF Llama (4 layers, hidden 1024) + AdamW
    python -m bench checkpoint --layers 8             # a bigger checkpoint
    python -m bench checkpoint --quick                # small, seconds (tests)

The model is bench.layers' HF Llama (transformers' LlamaForCausalLM, oases.parallelize at TP =
the ranks) with AdamW state (one step), so a checkpoint holds what a training run's does. It is
written under `--dir` (default: `--out`, so on the disk results go to), `--iters` times each:

    save        oases.save_checkpoint(model, root, optimizer=, step=i, keep=2): everything it does
                (DCP's writes and file fsyncs, crc32 read-back, marker, renames, directory fsyncs)
    load        oases.load_checkpoint(model, root, optimizer=) three ways: verify=True (the
                default: sizes, .metadata's and every read item's crc32), verify=False (sizes only),
                trusted=False (verified, and no pickle run)
    verify      oases.verify_checkpoint(root): every file's crc32, each read once across the ranks

and the parts of a save, each on this rank's own share (its `.distcp` files, from the page cache
as the save reads them):

    crc32       zlib.crc32 of a 64 MiB buffer in memory (GiB/s on one core)
    checksums   oases' per-file pass (whole file and per stored item) over this rank's files
    fsync       this rank's bytes written to a fresh file, then os.fsync: the write and the
                fsync timed apart (DCP fsyncs every file it writes: this is that cost)
    dir fsync   one rename and the fsync of its directory (a save makes three)

Times are medians over `--iters` (MAX over ranks); the table gives each part's share of a save.
A page-cache-warm, one-disk measurement: the fsync figures are this machine's disk, the checksum
figures its CPU. Records are in seconds and bytes.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import tempfile
import time
import zlib
from typing import Callable

import torch
import torch.distributed as dist

from bench._llama import parallelized
from bench._report import Table, pyplot, save_figure

QUICK = dict(layers=1, hidden=128, heads=4, kv_heads=2, seq_len=32)
_CRC_BUFFER = 64 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: --out)")


def _settings(args) -> dict[str, int]:
    if args.quick:
        return dict(QUICK)
    return {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads")} | {"seq_len": 32}


def _median_local(fn: Callable[[], object], iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _max(ctx, values: list[float]) -> list[float]:
    return ctx.timer.max_over_ranks(torch.tensor(values, dtype=torch.float64)).tolist()


def _sum(ctx, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)  # NCCL reduces device tensors only
    dist.all_reduce(t, group=ctx.group)
    return t.cpu().tolist()


def _crc32_seconds(iters: int) -> float:
    buffer = os.urandom(_CRC_BUFFER)
    return _median_local(lambda: zlib.crc32(buffer), iters)


def _own_files(step_dir: str, rank: int) -> list[str]:
    return sorted(glob.glob(os.path.join(step_dir, f"__{rank}_*.distcp")))


def _checksum_seconds(step_dir: str, files: list[str], iters: int) -> float:
    """oases' per-file checksum pass (whole file and its recorded items) over `files`."""
    from oases.storage import integrity as _dcp

    recorded = _dcp.read_marker(step_dir)["checksums"]["files"]
    spans = {f: [tuple(i[:2]) for i in recorded[os.path.basename(f)].get("items", ())] for f in files}
    return _median_local(lambda: [_dcp.file_checksums(f, spans[f]) for f in files], iters)


def _fsync_seconds(scratch: str, nbytes: int, iters: int) -> tuple[float, float]:
    """(write, fsync) medians of `nbytes` written to a fresh file in `scratch`, then fsynced."""
    block = os.urandom(min(nbytes, 16 << 20)) if nbytes else b""
    writes, syncs = [], []
    for i in range(iters):
        path = os.path.join(scratch, f"fsync-{i}")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            left = nbytes
            while left > 0:
                left -= f.write(block[: min(left, len(block))])
            f.flush()
            t1 = time.perf_counter()
            os.fsync(f.fileno())
        t2 = time.perf_counter()
        writes.append(t1 - t0)
        syncs.append(t2 - t1)
        os.remove(path)
    return statistics.median(writes), statistics.median(syncs)


def _dir_fsync_seconds(scratch: str, iters: int) -> float:
    """One rename in `scratch` and the fsync of `scratch` (what publishing a step does)."""
    from oases.storage import integrity as _dcp

    a, b = os.path.join(scratch, "a"), os.path.join(scratch, "b")
    os.mkdir(a)
    names = [(a, b), (b, a)]

    def once(i=[0]) -> None:
        src, dst = names[i[0] % 2]
        i[0] += 1
        os.rename(src, dst)
        _dcp.fsync_dir(scratch)

    seconds = _median_local(once, iters)
    shutil.rmtree(scratch, ignore_errors=True)
    return seconds


def run(args, ctx) -> list[dict]:
    import oases

    s = _settings(args)
    _, model = parallelized(s, ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # the moments exist: a training run's checkpoint

    base = args.dir or args.out
    root, error = "", None
    if ctx.rank == 0:
        try:
            os.makedirs(base, exist_ok=True)
            root = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=base)
        except OSError as e:  # every rank raises below, none waits for a folder
            error = e
    root = _broadcast(ctx, root)
    if not root:
        raise RuntimeError(f"bench checkpoint: rank 0 could not make a folder under {base}: {error}")
    try:
        records = _measure(ctx, oases, model, optimizer, root, s)
    except BaseException:
        if ctx.rank == 0:  # best effort, no collective: a peer may be stuck in one
            shutil.rmtree(root, ignore_errors=True)
        raise
    dist.barrier(group=ctx.group)  # every rank is done with the files
    if ctx.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return records


def _broadcast(ctx, text: str) -> str:
    """Rank 0's `text` on every rank."""
    box = [text]
    dist.broadcast_object_list(box, src=0, group=ctx.group, device=ctx.device if ctx.is_cuda else None)
    return box[0]


def _sound(verdict: object) -> None:
    if verdict is not None:
        raise RuntimeError(f"bench checkpoint: the checkpoint it wrote does not verify: {verdict}")


def _measure(ctx, oases, model, optimizer, root: str, s: dict) -> list[dict]:
    from oases.storage import publish as _dcp

    steps = iter(range(1, 10**6))

    def save() -> None:
        oases.save_checkpoint(model, root, optimizer=optimizer, step=next(steps), keep=2, group=ctx.group)

    def load(**options) -> Callable[[], object]:
        return lambda: oases.load_checkpoint(model, root, optimizer=optimizer, group=ctx.group, **options)

    loads = {
        "load": load(),
        "load verify=False": load(verify=False),
        "load trusted=False": load(trusted=False),
        "verify_checkpoint": lambda: _sound(oases.verify_checkpoint(newest, group=ctx.group)),
    }
    timed = ctx.timer.measure({"save": save})
    newest = _dcp.steps(root)[0][1]  # the step the loads read (the newest, sound)
    timed |= ctx.timer.measure(loads)

    files = _own_files(newest, ctx.rank)
    own = sum(os.path.getsize(f) for f in files)
    total = sum(os.path.getsize(f) for f in glob.glob(os.path.join(newest, "*")) if os.path.isfile(f))
    iters = max(3, ctx.timer.iters)
    scratch = tempfile.mkdtemp(prefix=f"scratch-{ctx.rank}-", dir=root)
    crc = _crc32_seconds(iters)
    checksums = _checksum_seconds(newest, files, iters)
    write, fsync = _fsync_seconds(scratch, own, iters)
    dir_fsync = _dir_fsync_seconds(scratch, iters)
    crc, checksums, write, fsync, dir_fsync = _max(ctx, [crc, checksums, write, fsync, dir_fsync])
    (largest,) = _max(ctx, [float(own)])
    (written,) = _sum(ctx, [float(own)])

    config = {**s, "tp": ctx.world_size, "iters": ctx.timer.iters, "dir": os.path.dirname(root)}
    t_save = timed["save"].median
    records = [
        {
            "kind": "operation",
            "name": name,
            "t": t.median,
            "t_min": t.min,
            "checkpoint_bytes": total,
            "rank_bytes_max": largest,
            "config": config,
        }
        for name, t in timed.items()
    ]
    parts = [
        ("crc32 (64 MiB in memory)", crc, _CRC_BUFFER, None),
        ("checksums (own files, whole + items)", checksums, largest, checksums),
        ("write (own bytes, page cache)", write, largest, None),
        ("fsync (own bytes)", fsync, largest, fsync),
        ("dir fsync (one; a save does 3)", dir_fsync, None, 3 * dir_fsync),
    ]
    for name, seconds, nbytes, in_save in parts:
        records.append(
            {
                "kind": "part",
                "name": name,
                "t": seconds,
                "bytes": nbytes,
                "gib_per_s": nbytes / seconds / 2**30 if nbytes and seconds else None,
                "share_of_save": in_save / t_save if in_save is not None and t_save else None,
                "checkpoint_bytes": total,
                "rank_bytes_max": largest,
                "written_bytes": written,
                "config": config,
            }
        )
    return records


def tables(records: list[dict]) -> list[Table]:
    if not records:
        return []
    c = records[0]["config"]
    mib = records[0]["checkpoint_bytes"] / 2**20
    ops = [r for r in records if r["kind"] == "operation"]
    save = next((r["t"] for r in ops if r["name"] == "save"), None)
    load = next((r["t"] for r in ops if r["name"] == "load"), None)
    op_rows = [
        [
            r["name"],
            f"{1e3 * r['t']:.1f}",
            f"{1e3 * r['t_min']:.1f}",
            f"{r['checkpoint_bytes'] / r['t'] / 2**30:.2f}",
            f"{r['t'] / load:.2f}x" if load and r["name"].startswith(("load", "verify")) else None,
        ]
        for r in ops
    ]
    part_rows = [
        [
            r["name"],
            f"{1e3 * r['t']:.1f}",
            f"{r['bytes'] / 2**20:.1f}" if r["bytes"] else None,
            f"{r['gib_per_s']:.2f}" if r["gib_per_s"] else None,
            f"{100 * r['share_of_save']:.0f}%" if r["share_of_save"] is not None else None,
        ]
        for r in records
        if r["kind"] == "part"
    ]
    title = (
        f"checkpoint: HF Llama {c['layers']} layers, hidden {c['hidden']} + AdamW, TP {c['tp']}, "
        f"{mib:.1f} MiB on disk, median of {c['iters']} (MAX over ranks)"
    )
    return [
        Table(
            title,
            ["operation", "ms", "min ms", "GiB/s", "vs load"],
            op_rows,
            [
                "save: save_checkpoint(step=, keep=2) whole; load: load_checkpoint (verify=True, the default);",
                "GiB/s: the checkpoint's bytes over the time; vs load: against the default load",
            ],
        ),
        Table(
            "checkpoint: the parts of a save on one rank's share (its own files)",
            ["part", "ms", "MiB", "GiB/s", "of save"],
            part_rows,
            [
                f"of save: the part's time in one save ({1e3 * save:.1f} ms) as the save does it"
                if save
                else "of save: n/a",
                "fsync: DCP fsyncs each file it writes; dir fsync: the directory entries after each rename",
            ],
        ),
    ]


def plot(records: list[dict], path: str, title: str) -> bool:
    ops = [r for r in records if r["kind"] == "operation"]
    if not ops:
        return False
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 3.8))
    names = [r["name"] for r in ops]
    ax.barh(names, [1e3 * r["t"] for r in ops], color="tab:blue")
    ax.invert_yaxis()
    ax.set_xlabel("ms (median, MAX over ranks)")
    ax.grid(alpha=0.3, axis="x")
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)
