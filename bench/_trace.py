"""Intervals of one instrumented call, for a Chrome/Perfetto trace (tid 0 compute, 1 communication).

    recorder = Recorder(rank)
    with instrument(recorder, label="all_gather_linear"):
        ops.all_gather_linear(x, w)         # GEMM calls -> tid 0, waits on the ring -> tid 1
    events = recorder.events                # Chrome "X" events, ts/dur in microseconds

`instrument` wraps, for the duration of the block only, the library's GEMM entry points
(`oases.ops._gemm.linear_into`, `F.linear` as seen by `oases.ops.linear_reduce_scatter`) and the
ring's `_post` / `_wait` (`oases.comm.ring`). Nothing in the library changes outside the block,
so timed iterations run the unpatched hot path. What the hooks cannot see (the partial-sum adds
of a reduce-scatter, copies) shows as gaps. Timestamps are CLOCK_MONOTONIC, shared by every
process of the machine, so ranks line up without a clock exchange.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import time
from typing import Any, Callable, Iterator, Optional

import torch

COMPUTE, COMM, OP, DP, IN_FLIGHT = 0, 1, 2, 3, 4
THREAD_NAMES = {
    COMPUTE: "compute",
    COMM: "communication",
    OP: "op",
    DP: "data-parallel sync",
    IN_FLIGHT: "collectives in flight",
}


class Recorder:
    """Collects ph "X" events of one rank; `sync` (CUDA) makes host intervals match the device."""

    def __init__(self, rank: int, sync: Optional[Callable[[], None]] = None) -> None:
        self.rank = rank
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


class _LinearOnly:
    """A stand-in for torch.nn.functional whose `linear` is recorded; everything else passes through."""

    def __init__(self, functional: Any, linear: Callable[..., torch.Tensor]) -> None:
        self._functional = functional
        self.linear = linear

    def __getattr__(self, name: str) -> Any:
        return getattr(self._functional, name)


def _recorded(recorder: Recorder, fn: Callable, name: str, tid: int, label: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with recorder.span(name, tid, op=label):
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def instrument(recorder: Recorder, label: str) -> Iterator[list[str]]:
    """Record the library's GEMMs and ring waits/posts inside the block; yields the hooks applied."""
    # import_module, not `import a.b as m`: oases.ops re-exports functions under its modules' names.
    ring = importlib.import_module("oases.comm.ring")
    gemm = importlib.import_module("oases.ops._gemm")
    lrs = importlib.import_module("oases.ops.linear_reduce_scatter")

    patches = [
        (gemm, "linear_into", lambda f: _recorded(recorder, f, "gemm", COMPUTE, label)),
        (lrs, "F", lambda f: _LinearOnly(f, _recorded(recorder, f.linear, "gemm", COMPUTE, label))),
        (ring, "_wait", lambda f: _recorded(recorder, f, "wait", COMM, label)),
        (ring, "_post", lambda f: _recorded(recorder, f, "post", COMM, label)),
    ]
    saved = []
    try:
        for module, attr, wrap in patches:
            if hasattr(module, attr):  # a renamed hook in the library drops out, never breaks
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, wrap(getattr(module, attr)))
        with recorder.span(label, OP):
            yield [f"{m.__name__}.{a}" for m, a, _ in saved]
    finally:
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)


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
