"""What the cores gave a step: the other threads' CPU time, and the calling thread's time on a CPU
and waiting for one.

    with OtherThreadsCPU() as other:
        step()
    other.seconds   # user + system CPU seconds the other threads (gloo's, a communicator's) used

    on_cpu, queued = thread_schedstat()   # the calling thread's seconds so far (Linux), or None
    thread_queued()                       # the second alone (NaN without schedstat)

The process's CPU time (all its threads, ended ones included) minus the calling thread's own, over
the block. On a machine where compute keeps every core busy, this is CPU time the compute could
not have: the transfers' own cost to the cores, which no schedule hides.
"""

from __future__ import annotations

import math
import time
from typing import Optional

_SCHEDSTAT = "/proc/thread-self/schedstat"


class OtherThreadsCPU:
    """CPU seconds used during the block by the process's threads other than the one entering it."""

    def __init__(self) -> None:
        self.seconds: Optional[float] = None

    def __enter__(self) -> "OtherThreadsCPU":
        self._process, self._own = time.process_time(), time.thread_time()
        return self

    def __exit__(self, *exc) -> None:
        process, own = time.process_time() - self._process, time.thread_time() - self._own
        self.seconds = max(process - own, 0.0)


def thread_schedstat() -> Optional[tuple[float, float]]:
    """(seconds on a CPU, seconds runnable but waiting for a CPU) of the calling thread since it
    started, from Linux's /proc/thread-self/schedstat (run time, run-queue wait, time slices; in
    ns); None where the kernel gives none (or only zeros). A thread is at each moment on a CPU, queued for
    one, or blocked (sleeping, e.g. in a wait): the queued time is what sharing the cores with other
    threads and processes cost it, measured by the scheduler itself."""
    try:
        with open(_SCHEDSTAT) as f:
            on_cpu, queued = (int(v) for v in f.read().split()[:2])
    except (OSError, ValueError):
        return None
    # a kernel without schedstats (and without delay accounting) shows "0 0 0": nothing measured
    return None if on_cpu == 0 else (on_cpu * 1e-9, queued * 1e-9)


def thread_queued() -> float:
    """The calling thread's run-queue wait so far in seconds (thread_schedstat; NaN without it)."""
    sched = thread_schedstat()
    return math.nan if sched is None else sched[1]
