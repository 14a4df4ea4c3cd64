"""Barrier-aligned timing: per-rank medians, then the MAX over ranks, so every rank reports one figure.

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
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

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
        for _ in range(self.warmup):
            for name in names:
                self._barrier()
                fns[name]()
        samples: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(self.iters):
            for name in names:
                samples[name].append(self._time_once(fns[name]))
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
        start_s = time.perf_counter()
        fn()
        return time.perf_counter() - start_s

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise MAX of a CPU float tensor over the ranks of the group (every rank gets it)."""
        if self.device.type == "cuda":  # NCCL reduces device tensors only
            on_device = values.to(self.device)
            dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=self.group)
            return on_device.cpu()
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return values
