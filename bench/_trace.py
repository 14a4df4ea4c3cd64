"""Intervals of a rank's work, for a Chrome/Perfetto trace (tid 0 compute, 1 communication, ...).

    recorder = Recorder(rank)
    with profiled(recorder, RING_RANGES) as span:        # one torch.profiler session
        with span("all_gather_linear", OP):             # the call on tid OP
            ops.all_gather_linear(x, w)                 # its GEMMs -> tid 0, ring posts / waits -> tid 1
    events = recorder.events                            # Chrome "X" events, ts/dur in microseconds

`profiled` reads the `torch.profiler.record_function` ranges the library opens, never patching it:

    oases::gemm            ops.gemm.linear_into, and linear_reduce_scatter's forward GEMM per piece
    oases::ring::post      comm.ring: one ring step's isend/irecv pair handed to the backend
    oases::ring::wait      comm.ring: waiting for a ring step's messages
    oases::schedule::wait  schedule.runtime: a Communicator handle's wait() (bench layers)

The profiler starts before the block and its events are read after it, so neither falls inside a
span. Each range that starts inside a span becomes one event (the outermost of nested ranges of one
name), placed on the span's clock (time.perf_counter, CLOCK_MONOTONIC, shared by every process of
the machine, so ranks line up without a clock exchange) through a marker range the span opens.
On CUDA (Recorder(cuda=True)) a range that launched device work (the GEMM's kernel, NCCL's) is
placed where that work ran on the GPU, from its first kernel's start to its last one's end; a
range that launched none (a wait: stream-ordered, it does not block the host) keeps its host
interval. What no range covers (the partial-sum adds of a reduce-scatter, copies) shows as gaps.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping, Optional, Sequence

import torch
from torch.autograd import DeviceType

COMPUTE, COMM, OP, DP, IN_FLIGHT = 0, 1, 2, 3, 4
THREAD_NAMES = {
    COMPUTE: "compute",
    COMM: "communication",
    OP: "op",
    DP: "data-parallel sync",
    IN_FLIGHT: "collectives in flight",
}

# range name -> (event name, "{label}" the span's label; tid)
RING_RANGES: dict[str, tuple[str, int]] = {
    "oases::gemm": ("gemm", COMPUTE),
    "oases::ring::post": ("post", COMM),
    "oases::ring::wait": ("wait", COMM),
}
WAIT_RANGES: dict[str, tuple[str, int]] = {"oases::schedule::wait": ("{label} wait", COMM)}
_MARKER = "bench::span"


class Recorder:
    """Collects ph "X" events of one rank; `sync` (CUDA) makes host intervals match the device;
    `cuda`: `profiled` also records CUDA activity (ranges placed where their kernels ran)."""

    def __init__(self, rank: int, sync: Optional[Callable[[], None]] = None, cuda: bool = False) -> None:
        self.rank = rank
        self.cuda = cuda
        self.events: list[dict[str, Any]] = []
        self._sync = sync or (lambda: None)

    @contextlib.contextmanager
    def span(self, name: str, tid: int, **args: Any) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            stop = time.perf_counter()
            self.interval(name, tid, start, stop, **args)

    def interval(self, name: str, tid: int, start: float, stop: float, **args: Any) -> None:
        """An event of times measured elsewhere (time.perf_counter seconds)."""
        self.events.append(
            {
                "name": name,
                "ph": "X",
                "pid": self.rank,
                "tid": tid,
                "ts": start * 1e6,
                "dur": (stop - start) * 1e6,
                "args": args,
            }
        )


@contextlib.contextmanager
def profiled(
    recorder: Recorder, ranges: Mapping[str, tuple[str, int]]
) -> Iterator[Callable[..., ContextManager[None]]]:
    """One torch.profiler session around the block; yields span(name, tid, label=name), a
    Recorder span whose `ranges` become events (args op=label) once the session has ended."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if recorder.cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    numbers = itertools.count()
    spans: list[tuple[str, str, float]] = []  # (marker, label, perf_counter at the marker's start)

    @contextlib.contextmanager
    def span(name: str, tid: int, label: Optional[str] = None) -> Iterator[None]:
        marker = f"{_MARKER}{next(numbers)}"
        with recorder.span(name, tid):
            anchor = time.perf_counter()
            with torch.profiler.record_function(marker):
                yield
        spans.append((marker, label or name, anchor))

    with torch.profiler.profile(activities=activities) as profile:
        yield span
    events = list(profile.events())
    windows = {e.name: e.time_range for e in events if e.name.startswith(_MARKER)}
    for marker, label, anchor in spans:
        window = windows.get(marker)
        if window is None:  # the profiler lost it: nothing to place
            continue
        offset = anchor - window.start / 1e6  # perf_counter seconds - profiler seconds
        for name, start, stop in ranges_in(events, ranges, window.start, window.end):
            event, tid = ranges[name]
            recorder.interval(event.format(label=label), tid, offset + start / 1e6, offset + stop / 1e6, op=label)


def ranges_in(events: Sequence[Any], names: Iterable[str], start: float, stop: float) -> list[tuple[str, float, float]]:
    """(name, start, stop) of each range in `names` starting in [start, stop] (profiler
    microseconds), the outermost of nested ranges of one name on one thread. A range whose CPU ops
    launched device work (kernels, copies: events linked to theirs) gets that work's interval."""
    names = set(names)
    cpu = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.time_range.start)
    device: dict[int, list[Any]] = {}
    for e in events:
        if e.device_type != DeviceType.CPU and e.linked_correlation_id:
            device.setdefault(e.linked_correlation_id, []).append(e)
    out: list[tuple[str, float, float]] = []
    open_until: dict[tuple[str, int], float] = {}
    for e in cpu:
        r, key = e.time_range, (e.name, e.thread)
        if e.name not in names or not start <= r.start <= stop or r.start < open_until.get(key, -math.inf):
            continue  # not asked for, outside the span, or inside one of its own name
        open_until[key] = r.end
        launched = [
            d
            for c in (cpu if device else ())
            if c.thread == e.thread and r.start <= c.time_range.start <= r.end
            for d in device.get(c.id, ())
        ]
        if launched:
            out.append((e.name, min(d.time_range.start for d in launched), max(d.time_range.end for d in launched)))
        else:
            out.append((e.name, r.start, r.end))
    return out


def chrome_trace(events_by_rank: list[list[dict[str, Any]]], metadata: dict[str, Any]) -> dict[str, Any]:
    """One Chrome/Perfetto trace of every rank's events; time 0 = the earliest event."""
    flat = [e for events in events_by_rank for e in events]
    origin = min((e["ts"] for e in flat), default=0.0)
    trace_events: list[dict[str, Any]] = []
    for rank, events in enumerate(events_by_rank):
        trace_events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
        )
        for tid, name in THREAD_NAMES.items():
            trace_events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
        for e in events:
            trace_events.append({**e, "ts": round(e["ts"] - origin, 3), "dur": round(e["dur"], 3)})
    return {"traceEvents": trace_events, "displayTimeUnit": "ms", "metadata": metadata}
