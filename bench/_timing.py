"""Timers: barrier-aligned across ranks (Timer), or one process's own (event_times, host_times).

    timer = Timer(group, device, warmup=2, iters=5)
    t = timer.measure({"serial": serial_fn, "ours": ours_fn})     # {"serial": Timing, ...}
    t["ours"].median, t["ours"].min                                # seconds

Each timed call of each variant is: barrier; start; fn(); stop (CUDA: events recorded around
fn() on the current stream, then synchronize; CPU: perf_counter). The variants run round-robin
(serial, ours, serial, ours, ...) so a machine that drifts during the run drifts for all of them
alike; comparisons between variants of one `measure` call are the ones to trust. A variant's
figure is the median of its timed calls on each rank, then the MAX of that over ranks (one
all_reduce): the slowest rank decides how long a step of a tensor-parallel program takes.

Each figure also comes with its minimum (per-rank minimum, then MAX over ranks): on a machine
shared with other jobs the median carries their load, the minimum is the least disturbed call.

One process, one GPU (no process group; medians of round-robin calls as above):

    event_times({"a": fa, "b": fb}, sets=k)   CUDA events around each call, no host synchronisation
                                              between calls (the queue stays full: the GPU's time);
                                              fn(i) reads input set i % k; `issue=` gets host issue times
    host_times({"a": fa}, sync=...)           host clock: sync(); start; fn(); sync(); stop (launch
                                              and issue overhead included)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

MIN_WARMUP = 2
MIN_ITERS = 5


@dataclass(frozen=True)
class Timing:
    median: float  # seconds: MAX over ranks of each rank's median
    min: float  # seconds: MAX over ranks of each rank's fastest call


@dataclass
class Timer:
    group: Optional[dist.ProcessGroup]
    device: torch.device
    warmup: int = MIN_WARMUP
    iters: int = MIN_ITERS

    def measure(self, fns: dict[str, Callable[[], object]]) -> dict[str, "Timing"]:
        """Seconds per call of each fn: MAX over ranks of the per-rank median (same on every rank)."""
        names = list(fns)
        samples = _round_robin(fns, self._time_once, warmup=self.warmup, iters=self.iters, settle=self._barrier)
        local = [statistics.median(samples[n]) for n in names] + [min(samples[n]) for n in names]
        reduced = self.max_over_ranks(torch.tensor(local, dtype=torch.float64)).tolist()
        return {name: Timing(reduced[i], reduced[len(names) + i]) for i, name in enumerate(names)}

    def _barrier(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def _time_once(self, fn: Callable[[], object]) -> float:
        self._barrier()
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(stop) / 1e3
        return host_seconds(fn)

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise MAX of a CPU float tensor over the ranks of the group (every rank gets it)."""
        if self.device.type == "cuda":  # NCCL reduces device tensors only
            on_device = values.to(self.device)
            dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=self.group)
            return on_device.cpu()
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return values


def _nothing() -> None:
    return None


def _round_robin(
    fns: Mapping[str, Callable[[], object]],
    time_once: Callable[[Callable[[], object]], float],
    *,
    warmup: int,
    iters: int,
    settle: Callable[[], None],
) -> dict[str, list[float]]:
    """`warmup` untimed rounds (settle(); fn()), then `iters` rounds of time_once(fn), the fns in
    turn (a, b, a, b, ...): each fn's seconds per timed call."""
    for _ in range(warmup):
        for fn in fns.values():
            settle()
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            samples[name].append(time_once(fn))
    return samples


def host_seconds(fn: Callable[[], object], sync: Callable[[], object] = _nothing) -> float:
    """Host seconds of one call: sync(); start; fn(); sync(); stop. What fn returns lives until the
    second sync (the work it queued may still read it)."""
    sync()
    start = time.perf_counter()
    kept = fn()
    sync()
    seconds = time.perf_counter() - start
    del kept
    return seconds


def host_times(
    fns: Mapping[str, Callable[[], object]],
    *,
    warmup: int = MIN_WARMUP,
    iters: int = MIN_ITERS,
    sync: Callable[[], object] = _nothing,
) -> dict[str, float]:
    """Median host seconds per call of each fn (`host_seconds`), round-robin; one process."""
    samples = _round_robin(fns, lambda fn: host_seconds(fn, sync), warmup=warmup, iters=iters, settle=sync)
    return {name: statistics.median(v) for name, v in samples.items()}


def event_times(
    fns: Mapping[str, Callable[[int], object]],
    *,
    sets: int = 1,
    warmup: int = MIN_WARMUP,
    iters: int = MIN_ITERS,
    issue: Optional[dict[str, float]] = None,
) -> dict[str, float]:
    """Median seconds per call of each fn, from CUDA events around each call; one process.

    warmup rounds of every fn, then iters rounds, round-robin (a, b, a, b, ...);
    call k (counted over all fns) gets k % sets, the input set to read;
    no host synchronisation between calls, one at the end
    issue: if given, gets each fn's median host seconds to issue one call (when that is close
    to the event time, the GPU waited for the host: the call is host-bound)
    """
    names = list(fns)
    k = 0
    for _ in range(warmup):
        for name in names:
            fns[name](k % sets)
            k += 1
    torch.cuda.synchronize()
    events: dict[str, list[tuple[Any, Any]]] = {name: [] for name in names}
    issued: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(iters):
        for name in names:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            begin = time.perf_counter()
            fns[name](k % sets)
            issued[name].append(time.perf_counter() - begin)
            stop.record()
            events[name].append((start, stop))
            k += 1
    torch.cuda.synchronize()
    if issue is not None:
        issue.update({name: statistics.median(v) for name, v in issued.items()})
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) / 1e3 for name, pairs in events.items()}
