"""cuda_micro's copy and stream sections: one GPU's ceilings, batched copies, stream priority.

    ceilings          device-to-device copy of 2 GiB (GB/s counting read + write bytes); bf16
                      8192^3 torch.mm (TFLOP/s); pinned host -> device and device -> host of
                      256 MiB (GB/s). Section batched_copies divides by the pinned ones.
    batched_copies    oases.offload.CopyEngine (one copy_out / copy_in call for n tensors, a
                      pinned HostSlab) against per-tensor t.to(..., non_blocking=True) and
                      per-tensor copy_ into preallocated pinned tensors; n in (16, 64, 256)
                      fp32 tensors of 16 KiB .. 16 MiB (at most 2 GiB a batch); D2H and H2D.
                      Timed on the host (bench._timing.host_times): synchronize; perf_counter; the
                      batch; synchronize (issue overhead included, which is the point). GB/s = n
                      size / t; x_to, x_copy = t_peer / t_engine; of_ceiling = engine GB/s / section
                      ceilings' pinned GB/s.
    stream_priority   latency (host perf_counter, issue -> event.synchronize()) of a small op
                      (an add of 1024 floats; an H2D copy of 64 KiB) issued on a priority -1
                      stream while a priority-0 stream runs ~50 ms of bf16 GEMMs, at random
                      points of that queue, against the same op on a second priority-0 stream
                      (and on an idle GPU); median and p90 over the trials.

The helpers above the sections are pure (tested on CPU); the sections need a GPU.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from bench._cuda_gemm import rand, spin_up
from bench._report import GIB, KIB, MIB, cell, size_label
from bench._timing import event_times, host_times

if TYPE_CHECKING:
    from bench.cuda_micro import Ctx, Section

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile: no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def copy_combos(counts: Sequence[int], sizes: Sequence[int], max_total: int) -> list[tuple[int, int]]:
    """(n, size) for every n in counts and size in sizes with n * size <= max_total, by size then n."""
    return [(n, s) for s in sizes for n in counts if n * s <= max_total]


# ---- ceilings ------------------------------------------------------------------------------------


def ceilings(ctx: Ctx, section: Section) -> None:
    dev, quick = ctx.device, ctx.quick
    warmup, iters = (1, 2) if quick else (2, 10)
    copy_bytes = 16 * MIB if quick else 2 * GIB
    n = 512 if quick else 8192
    pinned_bytes = 4 * MIB if quick else 256 * MIB
    table = section.table(
        "ceilings: one GPU's peaks (median of CUDA-event timed calls)",
        ["measure", "size", "t_ms", "rate", "unit"],
        [
            "d2d copy: GB/s counts the bytes read plus the bytes written (2x the size)",
            "matmul: torch.mm bf16, 2 n^3 flops; pinned copies: copy_(non_blocking=True)",
        ],
    )

    # F821 on the lambdas below is a false positive: they are called before the `del` of their names
    a, b = rand((n, n), torch.bfloat16, dev), rand((n, n), torch.bfloat16, dev)
    c = torch.empty((n, n), device=dev, dtype=torch.bfloat16)
    section.info["spin_up_s"] = spin_up(lambda: torch.mm(a, b, out=c), 0.05 if quick else 0.5)  # noqa: F821

    src = rand((copy_bytes // 4,), torch.float32, dev)
    dst = torch.empty_like(src)
    t = event_times({"d2d": lambda k: dst.copy_(src)}, warmup=warmup, iters=iters)["d2d"]  # noqa: F821
    ctx.ceilings["d2d"] = 2 * copy_bytes / t / 1e9
    table.rows.append(
        {
            "measure": "d2d copy",
            "size": size_label(copy_bytes),
            "t_ms": t * 1e3,
            "rate": ctx.ceilings["d2d"],
            "unit": "GB/s",
        }
    )
    del src, dst

    t = event_times({"mm": lambda k: torch.mm(a, b, out=c)}, warmup=warmup, iters=iters)["mm"]  # noqa: F821
    ctx.ceilings["bf16_tflops"] = 2 * n**3 / t / 1e12
    table.rows.append(
        {
            "measure": "bf16 matmul",
            "size": f"{n}^3",
            "t_ms": t * 1e3,
            "rate": ctx.ceilings["bf16_tflops"],
            "unit": "TFLOP/s",
        }
    )
    del a, b, c

    device_buf = torch.randint(0, 256, (pinned_bytes,), dtype=torch.uint8, device=dev)
    host_buf = torch.empty(pinned_bytes, dtype=torch.uint8, pin_memory=True)
    host_buf.copy_(device_buf)
    section.info["host_buffer_pinned"] = host_buf.is_pinned()
    times = event_times(
        {
            "h2d": lambda k: device_buf.copy_(host_buf, non_blocking=True),
            "d2h": lambda k: host_buf.copy_(device_buf, non_blocking=True),
        },
        warmup=warmup,
        iters=iters,
    )
    for name in ("h2d", "d2h"):
        ctx.ceilings[name] = pinned_bytes / times[name] / 1e9
        table.rows.append(
            {
                "measure": f"pinned {name}",
                "size": size_label(pinned_bytes),
                "t_ms": times[name] * 1e3,
                "rate": ctx.ceilings[name],
                "unit": "GB/s",
            }
        )
    section.info["ceilings"] = dict(ctx.ceilings)
    section.headline = (
        "ceilings: d2d {d2d:.0f} GB/s, bf16 mm {bf16_tflops:.0f} TFLOP/s, pinned h2d {h2d:.1f} / "
        "d2h {d2h:.1f} GB/s".format(**ctx.ceilings)
    )


# ---- batched_copies ------------------------------------------------------------------------------


def _import_offload() -> Any:
    """oases.offload, from the installed package or else from this checkout's python_api/."""
    try:
        import oases.offload as offload
    except ImportError:
        sys.path.insert(0, os.path.join(REPO_ROOT, "python_api"))
        import oases.offload as offload
    return offload


def batched_copies(ctx: Ctx, section: Section) -> None:
    offload = _import_offload()
    dev, quick = ctx.device, ctx.quick
    counts = (4, 16) if quick else (16, 64, 256)
    sizes = (16 * KIB, 256 * KIB) if quick else (16 * KIB, 256 * KIB, MIB, 16 * MIB)
    max_total = 16 * MIB if quick else 2 * GIB
    warmup, iters = (1, 2) if quick else (2, 10)
    combos = copy_combos(counts, sizes, max_total)
    capacity = max(n * s for n, s in combos)
    engine = offload.CopyEngine(dev)
    slab = offload.HostSlab(capacity)  # the engine's pinned slab
    pinned = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)  # per-tensor copy_ targets
    section.info.update(
        {
            "engine_path": engine.path,
            "slab_pinned": slab.buffer.is_pinned(),
            "skipped_over_bytes": max_total,
            "skipped": [f"{n} x {size_label(s)}" for s in sizes for n in counts if n * s > max_total],
        }
    )
    table = section.table(
        f"batched_copies: n fp32 tensors, one batch, host-timed (sync .. sync), GB/s = n size / t; engine path "
        f"{engine.path}",
        ["dir", "n", "size", "total", "engine_GBps", "to_GBps", "copy_GBps", "x_to", "x_copy", "of_ceiling"],
        [
            "engine: CopyEngine.copy_out(ts, slab, offsets).wait() / copy_in(slab, offsets, specs) + wait()",
            "to: [t.to('cpu' | device, non_blocking=True) for t in ts]; copy: [h.copy_(t, non_blocking=True)] into "
            "preallocated pinned (D2H) or device (H2D) tensors",
            "x_to, x_copy = t_peer / t_engine (> 1: the engine is faster); of_ceiling = engine GB/s / pinned "
            "ceiling of section ceilings",
        ],
    )
    checked = False
    for size in sizes:
        fitting = [n for n, s in combos if s == size]
        if not fitting:
            continue
        if ctx.over_budget():
            table.notes.append(f"stopped by the time budget before size {size_label(size)}")
            break
        numel = size // 4
        tensors = [rand((numel,), torch.float32, dev) for _ in range(max(fitting))]
        hosts = [pinned[i * size : (i + 1) * size].view(torch.float32) for i in range(max(fitting))]
        for n in fitting:
            ts, hs = tensors[:n], hosts[:n]
            offsets = [i * size for i in range(n)]
            specs = [((numel,), torch.float32)] * n
            if not checked:  # one round trip per path, bit for bit
                engine.copy_out(ts, slab.buffer, offsets).wait()
                back, event = engine.copy_in(slab.buffer, offsets, specs)
                event.wait()
                for h, t in zip(hs, ts):
                    h.copy_(t, non_blocking=True)
                torch.cuda.synchronize()
                to_host = ts[0].to("cpu", non_blocking=True)
                torch.cuda.synchronize()
                section.info["roundtrip_exact"] = all(torch.equal(a, b) for a, b in zip(back, ts)) and all(
                    torch.equal(h, t.cpu()) for h, t in zip(hs, ts)
                )
                section.info["to_cpu_non_blocking_is_pinned"] = to_host.is_pinned()
                if not section.info["roundtrip_exact"]:
                    raise AssertionError("batched_copies: a copy path did not give the tensors back bit for bit")
                checked = True
            d2h = host_times(
                {
                    "engine": lambda: engine.copy_out(ts, slab.buffer, offsets).wait(),
                    "to": lambda: [t.to("cpu", non_blocking=True) for t in ts],
                    "copy": lambda: [h.copy_(t, non_blocking=True) for h, t in zip(hs, ts)],
                },
                warmup=warmup,
                iters=iters,
                sync=torch.cuda.synchronize,
            )

            def engine_in() -> list[torch.Tensor]:
                outs, event = engine.copy_in(slab.buffer, offsets, specs)
                event.wait()
                return outs

            h2d = host_times(
                {
                    "engine": engine_in,
                    "to": lambda: [h.to(dev, non_blocking=True) for h in hs],
                    "copy": lambda: [t.copy_(h, non_blocking=True) for t, h in zip(ts, hs)],
                },
                warmup=warmup,
                iters=iters,
                sync=torch.cuda.synchronize,
            )
            for direction, times in (("d2h", d2h), ("h2d", h2d)):
                total = n * size
                ceiling = ctx.ceilings.get(direction)
                engine_gbps = total / times["engine"] / 1e9
                table.rows.append(
                    {
                        "dir": direction,
                        "n": n,
                        "size": size_label(size),
                        "total": size_label(total),
                        "engine_GBps": engine_gbps,
                        "to_GBps": total / times["to"] / 1e9,
                        "copy_GBps": total / times["copy"] / 1e9,
                        "x_to": times["to"] / times["engine"],
                        "x_copy": times["copy"] / times["engine"],
                        "of_ceiling": engine_gbps / ceiling if ceiling else None,
                        "t_ms": {k: v * 1e3 for k, v in times.items()},
                    }
                )
        del tensors, hosts
        torch.cuda.empty_cache()
        ctx.save()
    engine.synchronize()
    engine.close()
    x_copy = [r["x_copy"] for r in table.rows]
    if x_copy:
        section.headline = (
            f"batched_copies ({engine.path} path): engine vs per-tensor copy_ x{min(x_copy):.2f} .. "
            f"x{max(x_copy):.2f}; best of ceiling "
            f"{cell(max((r['of_ceiling'] or 0.0) for r in table.rows), 4)}"
        )


# ---- stream_priority -----------------------------------------------------------------------------


def _priority_range() -> Optional[tuple[int, int]]:
    """torch.cuda.Stream.priority_range() where this torch has it (static, or on an instance)."""
    for get in (lambda: torch.cuda.Stream.priority_range(), lambda: torch.cuda.Stream().priority_range()):
        try:
            low, high = get()
            return int(low), int(high)
        except Exception:
            continue
    return None


def stream_priority(ctx: Ctx, section: Section) -> None:
    dev, quick = ctx.device, ctx.quick
    n = 1024 if quick else 8192
    fill_s = 0.005 if quick else 0.05
    trials = 2 if quick else 20
    background = torch.cuda.Stream(dev, priority=0)
    streams = {"high": torch.cuda.Stream(dev, priority=-1), "normal": torch.cuda.Stream(dev, priority=0)}
    section.info["priority_range"] = _priority_range()
    section.info["stream_priorities"] = {k: s.priority for k, s in streams.items()}
    a, b = rand((n, n), torch.bfloat16, dev), rand((n, n), torch.bfloat16, dev)
    c = torch.empty((n, n), dtype=torch.bfloat16, device=dev)
    t_gemm = event_times({"mm": lambda k: torch.mm(a, b, out=c)}, warmup=2, iters=3)["mm"]
    gemms = max(1, min(2000, round(fill_s / t_gemm)))
    section.info.update(
        {
            "gemm": f"bf16 {n}^3",
            "gemm_ms": t_gemm * 1e3,
            "gemms_per_fill": gemms,
            "fill_ms": gemms * t_gemm * 1e3,
            "trials": trials,
        }
    )
    x, y, z = (rand((1024,), torch.float32, dev) for _ in range(3))
    host = torch.empty(64 * KIB, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.randint(0, 256, (64 * KIB,), dtype=torch.uint8, device=dev))
    dst = torch.empty(64 * KIB, dtype=torch.uint8, device=dev)
    ops: dict[str, Callable[[], object]] = {
        "add_1024": lambda: torch.add(x, y, out=z),
        "h2d_64KiB": lambda: dst.copy_(host, non_blocking=True),
    }
    rng = random.Random(0)

    def latency(op: Callable[[], object], stream: Any, busy: bool, delay_s: float) -> tuple[float, bool]:
        """Seconds from issuing op on `stream` to its event completing; whether the background
        GEMMs were still running when it completed."""
        torch.cuda.synchronize()
        bg_done = torch.cuda.Event()
        if busy:
            with torch.cuda.stream(background):
                for _ in range(gemms):
                    torch.mm(a, b, out=c)
                bg_done.record(background)
            time.sleep(delay_s)
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            start = time.perf_counter()
            op()
            done.record(stream)
            done.synchronize()
            seconds = time.perf_counter() - start
        still_busy = busy and not bg_done.query()
        torch.cuda.synchronize()
        return seconds, still_busy

    table = section.table(
        f"stream_priority: small op latency (issue -> done, host clock) while a priority-0 stream runs "
        f"{gemms} x bf16 {n}^3 GEMMs (~{gemms * t_gemm * 1e3:.0f} ms)",
        ["op", "stream", "priority", "median_us", "p90_us", "vs_high", "trials", "bg_busy"],
        [
            "high: torch.cuda.Stream(priority=-1); normal: a second priority-0 stream; idle: no background work",
            "the op is issued at a random point (5%..70%) of the GEMM queue; bg_busy: share of trials in which "
            "the GEMMs were still running when the op completed",
            "vs_high = this median / the high-priority stream's median",
        ],
    )
    for op_name, op in ops.items():
        if ctx.over_budget():
            table.notes.append(f"stopped by the time budget before {op_name}")
            break
        for stream in streams.values():  # warm-up: the op's kernel and the streams exist
            latency(op, stream, False, 0.0)
        samples: dict[str, list[float]] = {"high": [], "normal": [], "idle": []}
        busy_counts = {"high": 0, "normal": 0}
        for _ in range(trials):
            delay = rng.uniform(0.05, 0.7) * gemms * t_gemm
            for kind in ("high", "normal"):  # the same point of the queue for both
                seconds, busy = latency(op, streams[kind], True, delay)
                samples[kind].append(seconds)
                busy_counts[kind] += busy
            samples["idle"].append(latency(op, streams["high"], False, 0.0)[0])
        high_median = statistics.median(samples["high"])
        for kind, values in samples.items():
            median = statistics.median(values)
            table.rows.append(
                {
                    "op": op_name,
                    "stream": kind,
                    "priority": streams["normal" if kind == "normal" else "high"].priority,
                    "median_us": median * 1e6,
                    "p90_us": percentile(values, 90) * 1e6,
                    "vs_high": median / high_median,
                    "trials": len(values),
                    "bg_busy": busy_counts[kind] / len(values) if kind in busy_counts else None,
                    "samples_us": [v * 1e6 for v in values],
                }
            )
    ratios = {r["op"]: r["vs_high"] for r in table.rows if r["stream"] == "normal"}
    if ratios:
        section.headline = "stream_priority: normal / high median latency " + ", ".join(
            f"{op} x{v:.1f}" for op, v in ratios.items()
        )
