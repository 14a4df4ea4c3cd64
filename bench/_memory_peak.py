"""Where one run's peak device memory goes: the allocations live at the peak, grouped by the code
that made them, from the CUDA caching allocator's history.

    summary = peak_allocations(fn, device)   # runs fn() once with the history recorded (CUDA)
    # summary = {"peak_bytes": P, "events": E, "set_by": "programs.py:96 _program < ...",
    #            "groups": [{"frame": "programs.py:41 _record < ...", "bytes": B, "count": N}, ...]}

    P = max over the run of (bytes allocated now - bytes allocated when fn started), in the sizes
      the allocations asked for (torch.cuda.max_memory_allocated counts their blocks, rounded up
      to 512 bytes: slightly more)
    groups: the blocks live at that moment, by the innermost frames of the project (oases/, bench/,
    examples/) on their allocation's Python stack, largest first; frees of blocks allocated before
    the run count against P as the allocator counts them.

`live_at_peak(events)` is the replay, on the trace entries of torch.cuda.memory._snapshot().
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Callable, Optional, Sequence

import torch

__all__ = ["live_at_peak", "peak_allocations", "frame_label"]

_PROJECT = ("/oases/", "/bench/", "/examples/")


def live_at_peak(events: Sequence[dict]) -> tuple[int, Optional[int], list[dict]]:
    """Replay allocator trace entries ({"action", "addr", "size", ...}, in order):
    (peak bytes above the start, index of the entry that reached it or None, entries live then).

    alloc adds a block; free_requested takes it away (the allocator stops counting it there, also
    for a block from before the trace); free_completed only returns a block to the pool (a block
    freed with record_stream completes later; one requested before the trace was counted off
    already). Other actions (segment_*, snapshot, oom) move no allocated bytes."""

    def replay(stop: int):
        live: dict[int, dict] = {}
        now = 0
        for i, e in enumerate(events[:stop]):
            action, addr = e.get("action"), e.get("addr")
            if action == "alloc":
                live[addr] = e
                now += e["size"]
            elif action == "free_requested":
                live.pop(addr, None)
                now -= e["size"]
            # free_completed: the block back in the pool; no allocated bytes move
            yield i, now, live

    peak, peak_at = 0, None
    for i, now, _ in replay(len(events)):
        if now > peak:
            peak, peak_at = now, i
    if peak_at is None:
        return 0, None, []
    live: dict[int, dict] = {}
    for _, _, live in replay(peak_at + 1):
        pass
    return peak, peak_at, list(live.values())


def frame_label(frames: Sequence[dict], depth: int = 3) -> str:
    """'file.py:LINE name < caller.py:LINE name ...': the innermost `depth` frames of the project,
    else the innermost frame; '?' without frames."""
    mine = [f for f in frames if any(p in f.get("filename", "") for p in _PROJECT)]
    chosen = (mine or list(frames)[:1])[:depth]
    if not chosen:
        return "?"
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in chosen)


def peak_allocations(fn: Callable[[], object], device: torch.device, *, top: int = 12) -> dict:
    """Run fn() once on `device` (CUDA) with the allocator's history recorded; see the module docstring."""
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(
        enabled="all", context="alloc", stacks="python", max_entries=sys.maxsize, device=device
    )
    try:
        fn()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    traces = snapshot.get("device_traces", [])
    events = traces[index] if index < len(traces) else []
    peak, at, live = live_at_peak(events)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in live:
        g = groups[frame_label(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {
        "peak_bytes": peak,
        "events": len(events),
        "set_by": None if at is None else frame_label(events[at].get("frames", [])),
        "groups": [{"frame": k, "bytes": b, "count": n} for k, (b, n) in ranked[:top]],
        "other_bytes": sum(b for _, (b, _) in ranked[top:]),
    }
